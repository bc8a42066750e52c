"""Compiled context-parallel blocks on one GPU: inductor, fullgraph, no recompiles as document
layouts change, and the head exchanges kept or recomputed as the checkpointing mode says.

One process plays rank 0 of a cp=2 mesh over torch's fake process group: collectives return
without moving data, so the values are not checked (the CPU suite checks them against cp=1);
what is checked is what compiling the DTensor redistribution does on CUDA, where it is
`_dtensor.shard_dim_alltoall` with no separate wait.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims

from tests.conftest import OpCounter
from titan_gdn.model import Qwen35Model, qwen3_5_args
from titan_gdn.parallel.parallelize import parallelize_qwen3_5

pytestmark = pytest.mark.gpu

EOS, CP = 0, 2
ROWS, SEQ_LEN = 1, 1024
DOCUMENTS_PER_ROW = (1, 4, 9)  # a new document count every step
EXCHANGE = torch.ops._dtensor.shard_dim_alltoall.default
AC_MODES = {"none": ("none", "op"), "selective op": ("selective", "op"), "full": ("full", "op")}


@pytest.fixture(scope="module")
def cp_dims():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=CP)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=CP, tp=1, pp=1, ep=1, etp=1, world_size=CP)
    dims.build_mesh()
    yield dims
    dist.destroy_process_group()


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(1, 2048, (ROWS, SEQ_LEN + 1), generator=gen)
    ends = torch.randperm(SEQ_LEN - 1, generator=gen)[: DOCUMENTS_PER_ROW[step] - 1]
    tokens[0, ends] = EOS
    return tokens.cuda()


@pytest.mark.parametrize("ac", list(AC_MODES))
def test_compiled_context_parallel_blocks_compile_once(cp_dims, ac):
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen35Model(copy.deepcopy(qwen3_5_args["debugmodel"]))
        model.init_weights()
    job = JobConfig()
    job.activation_checkpoint.mode, job.activation_checkpoint.selective_ac_option = AC_MODES[ac]
    job.compile.enable, job.compile.components = True, ["model"]
    model = parallelize_qwen3_5(model, cp_dims, job)
    mixers = len(model.layers)
    counters.clear()
    for step in range(len(DOCUMENTS_PER_ROW)):
        batch = _batch(step)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        docs = model.get_attention_masks(inputs, _Tokenizer())
        shard = slice(0, SEQ_LEN // CP)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            logits = model(inputs[:, shard], attention_masks=docs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels[:, shard].flatten())
        with OpCounter() as backward:
            loss.backward()
        recomputed = mixers if ac == "full" else 0
        # One exchange per direction per mixer, twice for a block whose forward is recomputed.
        assert backward.calls[EXCHANGE] == 2 * (mixers + recomputed), (step, backward.calls)
    assert not counters["graph_break"], counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 2  # one per layer type


class _Tokenizer:
    eos_id = EOS
