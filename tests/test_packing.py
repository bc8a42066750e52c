"""Packed documents: every layer (conv, delta-rule state, attention) stops at document ends."""

import pytest
import torch

# The mixers call the ops through their sequence placement (`StatePassing`).
import titan_gdn.placements.state_passing as mixer_ops
from tests.conftest import perturb_norms_and_gates, relative_error
from tests.hf_reference import tiny_hf_config
from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.model import Qwen35Model, Qwen35ModelArgs

EOS = 0
DOC_LENGTHS = [1, 37, 150, 64, 1, 90, 23]  # length 1, not multiples of 64, one > 128


def _tiny_model(seed: int) -> Qwen35Model:
    torch.manual_seed(seed)
    model = Qwen35Model(Qwen35ModelArgs.from_hf_config(tiny_hf_config(tied=False, vocab_size=97)))
    model.init_weights()
    perturb_norms_and_gates(model)
    return model


def _documents(generator, lengths) -> list[torch.Tensor]:
    docs = []
    for length in lengths:
        body = torch.randint(1, 97, (length - 1,), generator=generator)
        docs.append(torch.cat([body, torch.tensor([EOS])]))
    return docs


def _forward_packed(model, tokens):
    return model(tokens, attention_masks=DocumentBoundaries.from_tokens(tokens, EOS))


def test_boundaries_from_tokens():
    tokens = torch.tensor([[5, EOS, 7, 8, EOS, 9], [EOS, 3, 4, 5, 6, EOS]])
    docs = DocumentBoundaries.from_tokens(tokens, EOS)
    assert docs.cu_seqlens.tolist() == [0, 2, 5, 6, 7, 12]
    assert docs.cu_seqlens.dtype == torch.int32
    assert docs.position_ids.tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4]]
    assert docs.document_ids.tolist() == [[0, 0, 1, 1, 1, 2], [3, 4, 4, 4, 4, 4]]


def test_each_packed_document_gets_its_logits_alone():
    model = _tiny_model(seed=0)
    generator = torch.Generator().manual_seed(1)
    docs = _documents(generator, DOC_LENGTHS)
    second_row = _documents(generator, [200, 100, 66])
    tokens = torch.stack([torch.cat(docs), torch.cat(second_row)])
    with torch.no_grad():
        packed = _forward_packed(model, tokens)
        for row, row_docs in enumerate([docs, second_row]):
            start = 0
            for doc in row_docs:
                alone = model(doc[None])[0]
                got = packed[row, start : start + len(doc)]
                assert relative_error(got, alone) <= 1e-5, (row, start, len(doc))
                start += len(doc)


def _other_documents_unchanged(model, changed_doc: int) -> bool:
    generator = torch.Generator().manual_seed(2)
    docs = _documents(generator, DOC_LENGTHS)
    edited = [d.clone() for d in docs]
    edited[changed_doc][:-1] = torch.randint(
        1, 97, (len(docs[changed_doc]) - 1,), generator=generator
    )
    with torch.no_grad():
        before = _forward_packed(model, torch.cat(docs)[None])[0]
        after = _forward_packed(model, torch.cat(edited)[None])[0]
    keep = torch.ones(before.shape[0], dtype=torch.bool)
    start = sum(DOC_LENGTHS[:changed_doc])
    keep[start : start + DOC_LENGTHS[changed_doc]] = False
    return torch.equal(before[keep], after[keep])


@pytest.mark.parametrize("changed_doc", [1, 2, 5])
def test_changing_one_document_leaves_the_others_bit_identical(changed_doc):
    assert _other_documents_unchanged(_tiny_model(seed=3), changed_doc)


def _whole_row(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return cu_seqlens[[0, -1]]


@pytest.mark.parametrize("leak", ["conv", "delta_rule", "attention"])
def test_the_isolation_check_catches_a_boundary_ignored_in_one_op(monkeypatch, leak):
    """The check above must fail when any single op lets a document see the previous one."""
    if leak == "conv":
        real = mixer_ops.causal_conv1d_silu
        monkeypatch.setattr(
            mixer_ops, "causal_conv1d_silu", lambda x, w, cu, b: real(x, w, _whole_row(cu), b)
        )
    elif leak == "delta_rule":
        real = mixer_ops.gated_delta_rule
        monkeypatch.setattr(
            mixer_ops,
            "gated_delta_rule",
            lambda q, k, v, g, beta, cu, backend: real(
                q, k, v, g, beta, _whole_row(cu), backend=backend
            ),
        )
    else:
        real = mixer_ops.document_causal_attention
        monkeypatch.setattr(
            mixer_ops,
            "document_causal_attention",
            lambda q, k, v, ids, mask, backend, *rest, **kwargs: real(
                q, k, v, torch.zeros_like(ids), None, backend, *rest, **kwargs
            ),
        )
    assert not _other_documents_unchanged(_tiny_model(seed=3), changed_doc=1)
