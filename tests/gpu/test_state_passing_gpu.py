"""FLA's context parallel delta rule (`fla.ops.cp`, through `fla_cp_op`) on CUDA in bf16,
against the torch delta rule in fp32 over the whole sequence.

On a one-rank NCCL group the op is FLA's plain kernel plus an empty exchange; its time against
the plain op is printed. Several ranks are simulated on one GPU: each chunk's forward and
backward run twice, once to record the summaries FLA all-gathers and once with all of them, so
FLA's summary and merge kernels are checked across chunk boundaries without a second GPU.
Needs a CUDA device: CI deselects it with ``-m "not gpu"``.
"""

import types

import pytest
import torch
import torch.distributed as dist

from tests.conftest import relative_error
from tests.gpu.test_delta_rule_gpu import INPUT_NAMES, random_inputs
from titan_gdn.boundaries import ChunkBoundaries, token_documents
from titan_gdn.ops.delta_rule import fla_cp_op, fla_op, gated_delta_rule

pytestmark = pytest.mark.gpu

TOKENS, DOCUMENTS, KEY_HEADS, VALUE_HEADS, HEAD_DIM = 4096, 9, 2, 4, 128


@pytest.fixture(autouse=True)
def fla_triton_path(monkeypatch):
    monkeypatch.setenv("FLA_FLASH_QLA", "0")
    fla_op.load_fla_kernels()


@pytest.fixture(scope="module")
def one_rank_group():
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD.group_name


def _padded(cu_seqlens, tokens):
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(tokens + 1 - len(cu_seqlens))])


def _chunk(cu_seqlens, start, end):
    """The boundaries of the chunk [start, end) of the one row whose documents are `cu_seqlens`."""
    document_ids = token_documents(cu_seqlens, TOKENS)[None]
    return ChunkBoundaries.of(document_ids, start, end, halo=0)


def _reference(inputs):
    """The torch backend in fp32 over the whole sequence: output and gradients."""
    leaves = [inputs[name].float().requires_grad_() for name in INPUT_NAMES]
    out = gated_delta_rule(*leaves, inputs["cu_seqlens"], backend="torch")
    grads = torch.autograd.grad((out * inputs["grad_out"].float()).sum(), leaves)
    return {"o": out, **{f"d{n}": g for n, g in zip(INPUT_NAMES, grads, strict=True)}}


def _assert_close(actual, expected, label, tolerance=1e-2):
    errors = {name: relative_error(actual[name].float(), expected[name]) for name in expected}
    print(f"{label}: " + ", ".join(f"{name} {error:.2e}" for name, error in errors.items()))
    assert all(error <= tolerance for error in errors.values()), errors


def test_one_rank_group_matches_torch_and_times_against_the_plain_op(one_rank_group):
    inputs = random_inputs(0, TOKENS, DOCUMENTS, KEY_HEADS, VALUE_HEADS, HEAD_DIM)
    padded = _padded(inputs["cu_seqlens"], TOKENS)
    whole_row = _chunk(inputs["cu_seqlens"], 0, TOKENS)

    def cp_op(*leaves):
        return fla_cp_op.fla_gated_delta_rule_cp(*leaves, whole_row, one_rank_group)

    def plain_op(*leaves):
        return gated_delta_rule(*leaves, padded, backend="fla")

    results = {}
    for name, fn in (("cp", cp_op), ("plain", plain_op)):
        leaves = [inputs[n].clone().requires_grad_() for n in INPUT_NAMES]
        out = fn(*leaves)
        grads = torch.autograd.grad((out.float() * inputs["grad_out"].float()).sum(), leaves)
        results[name] = {"o": out, **{f"d{n}": g for n, g in zip(INPUT_NAMES, grads, strict=True)}}
    expected = _reference(inputs)
    _assert_close(results["cp"], expected, "FLA cp op, one rank, bf16 vs torch fp32")
    _assert_close(results["plain"], expected, "FLA op, bf16 vs torch fp32")
    for name in expected:  # one rank: the same kernels on the same chunks
        error = relative_error(results["cp"][name].float(), results["plain"][name].float())
        assert error <= 1e-3, (name, error)
    times = {name: _time(fn, inputs) for name, fn in (("cp", cp_op), ("plain", plain_op))}
    print(
        f"forward + backward, {TOKENS} tokens: cp op {times['cp']:.3f} ms, plain op "
        f"{times['plain']:.3f} ms ({times['cp'] / times['plain']:.2f}x)"
    )


def _time(fn, inputs, repeats=20):
    leaves = [inputs[n].clone().requires_grad_() for n in INPUT_NAMES]
    for _ in range(3):
        torch.autograd.grad(fn(*leaves).float().sum(), leaves)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        torch.autograd.grad(fn(*leaves).float().sum(), leaves)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


class SimulatedGroup:
    """Ranks run one after another on one GPU. `all_gather_into_tensor` (FLA's, in
    `fla.ops.cp.chunk_delta_h`) records each rank's summary on a first pass and returns all
    of them on a second; `get_rank` answers the rank being run."""

    def __init__(self, size):
        self.size, self.rank, self.replay = size, 0, False
        self.recorded: dict[tuple[str, int], torch.Tensor] = {}
        self.phase = "forward"

    def all_gather_into_tensor(self, inp, out=None, group=None, async_op=False):
        if not self.replay:
            self.recorded[self.phase, self.rank] = inp.clone()
            return inp.new_zeros(self.size, *inp.shape), None
        return torch.stack([self.recorded[self.phase, r] for r in range(self.size)]), None

    def run(self, phase, fn):
        """fn(rank) for every rank, recorded then replayed: the replayed results."""
        self.phase = phase
        results = []
        for replay in (False, True):
            self.replay, results = replay, []
            for rank in range(self.size):
                self.rank = rank
                results.append(fn(rank))
        return results


@pytest.mark.parametrize("ranks", [2, 4])
def test_simulated_ranks_match_torch_over_the_whole_sequence(monkeypatch, ranks):
    """Documents cross every chunk boundary (and one chunk lies inside one document); each
    rank's context comes from its chunk's boundaries (`ChunkBoundaries`)."""
    from fla.ops.cp import chunk_delta_h

    inputs = random_inputs(1, TOKENS, 4, KEY_HEADS, VALUE_HEADS, HEAD_DIM)
    simulated = SimulatedGroup(ranks)
    fake_dist = types.SimpleNamespace(
        get_rank=lambda group=None: simulated.rank, get_world_size=lambda group=None: ranks
    )
    monkeypatch.setattr(chunk_delta_h, "all_gather_into_tensor", simulated.all_gather_into_tensor)
    monkeypatch.setattr(chunk_delta_h, "dist", fake_dist)

    def contexts(cu_seqlens, shared_chunks, group_name):
        # FLA skips the exchange without a group; the simulated one stands in for it.
        return fla_cp_op.cp_contexts(cu_seqlens, shared_chunks, group="simulated")

    monkeypatch.setattr(fla_cp_op, "row_contexts", contexts)
    size = TOKENS // ranks
    chunks = [_chunk(inputs["cu_seqlens"], r * size, (r + 1) * size) for r in range(ranks)]
    chunk = {
        name: [inputs[name][:, r * size : (r + 1) * size].contiguous() for r in range(ranks)]
        for name in (*INPUT_NAMES, "grad_out")
    }
    scale = HEAD_DIM**-0.5

    def forward(rank):
        args = [chunk[name][rank] for name in INPUT_NAMES]
        boundaries = chunks[rank].padded_cu_seqlens, chunks[rank].shared_chunks
        return fla_cp_op.gated_delta_rule_fla_cp(*args, *boundaries, "", scale)

    outputs = simulated.run("forward", forward)

    def backward(rank):
        residuals = outputs[rank][1:]
        grad_o = chunk["grad_out"][rank]
        beta = chunk["beta"][rank]
        boundaries = chunks[rank].padded_cu_seqlens, chunks[rank].shared_chunks
        return fla_cp_op.gated_delta_rule_fla_cp_backward(
            grad_o, *residuals, beta, *boundaries, "", scale
        )

    grads = simulated.run("backward", backward)
    actual = {"o": torch.cat([o[0] for o in outputs], dim=1)}
    for i, name in enumerate(INPUT_NAMES):
        actual[f"d{name}"] = torch.cat([g[i] for g in grads], dim=1)
    _assert_close(actual, _reference(inputs), f"FLA cp, {ranks} simulated ranks, bf16 vs fp32")
