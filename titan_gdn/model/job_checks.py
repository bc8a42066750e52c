"""The job config checked against the model args: what `Qwen35ModelArgs.update_from_config`
raises when torchtitan hands it the job, and what the whole-config check
(titan_gdn/validation.py) reports with the others before anything is built. They import
nothing of titan_gdn, so the args call them without depending on the code that gathers every
check."""

from __future__ import annotations


def job_config_problems(args, job_config, tokenizer=None) -> list[str]:
    """Why model args `args` cannot train with `job_config` (and `tokenizer`), as messages that
    name the setting to change; empty when it can."""
    problems = []
    cp = job_config.parallelism.context_parallel_degree
    if job_config.validation.enable:
        # torchtitan 0.2.2's Validator reads only its own HF datasets, skips our document
        # boundaries and shards with its CP load balancer: it would fail mid-run or be wrong.
        problems.append(
            "validation.enable = true is not supported yet (torchtitan's validator does not "
            "use the packed-document loader or the global document boundaries); set "
            "validation.enable = false"
        )
    seq_len = job_config.training.seq_len
    if seq_len > args.max_seq_len:
        problems.append(
            f"training.seq_len = {seq_len} exceeds the model's max_seq_len = "
            f"{args.max_seq_len}; raise model.max_seq_len to at least {seq_len} (RoPE is "
            "computed for any position) or lower training.seq_len"
        )
    if cp > 1 and seq_len % cp:
        problems.append(
            f"training.seq_len = {seq_len} is not divisible by "
            f"parallelism.context_parallel_degree = {cp}; use a multiple of {cp}"
        )
    if tokenizer is not None and tokenizer_id_bound(tokenizer) > args.vocab_size:
        problems.append(
            f"the tokenizer in model.hf_assets_path = {job_config.model.hf_assets_path!r} has "
            f"{tokenizer.get_vocab_size()} tokens with ids up to "
            f"{tokenizer_id_bound(tokenizer) - 1} but the model's vocab_size is "
            f"{args.vocab_size}: the tokenizer does not belong to model.flavor = "
            f"{job_config.model.flavor!r}; use the model's tokenizer or a flavor with a larger "
            "vocab"
        )
    return problems


def tokenizer_id_bound(tokenizer) -> int:
    """One past the largest id `tokenizer` can produce. Ids may be sparse (a special token
    placed beyond the rest), so the token count alone can understate it."""
    ids = [tokenizer.get_vocab_size() - 1, tokenizer.eos_id, getattr(tokenizer, "bos_id", None)]
    if hasattr(tokenizer, "get_vocab"):
        ids += tokenizer.get_vocab().values()
    return 1 + max(i for i in ids if i is not None)
