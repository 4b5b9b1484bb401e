"""`python -m raytrain_cpu.export`: a real 2-rank ZeRO-3 checkpoint -> an ordinary Hugging Face model.

The checkpoint comes from two spawned processes (gloo, DeepSpeed ZeRO-3, bf16, no Ray) that
train the tiny Llama three steps, record their logits on a batch and save through
checkpoint.write_checkpoint, exactly as training does. (Export at the end of a Ray run,
`run.export_on_finish`, is checked in tests/test_fault_tolerance.py.)
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_export_e2e.py."""

from __future__ import annotations

from pathlib import Path


def test_writer_skips_ties_not_reused_ids(tmp_path, monkeypatch):
    """A tied weight (one tensor, two names) is written once; a new tensor that got a freed one's id
    is not a tie. The merged LoRA weights are such temporaries, and an id set dropped some of them
    (CI: a merged export 1.3 off in its logits). CPython reuses ids when its allocator says so; here
    every tensor gets the same id, so the test does not depend on the allocator."""
    import torch
    from safetensors.torch import load_file

    from raytrain_cpu.model import export

    def temporaries():
        embed = torch.ones(4, 4)
        yield "embed_tokens.weight", embed
        yield "lm_head.weight", embed  # tied
        for i in range(4):
            yield f"layers.{i}.weight", torch.full((4, 4), float(i)) + 0  # freed once written

    monkeypatch.setattr(export, "id", lambda obj: 7, raising=False)
    written = export._write_safetensors(temporaries(), tmp_path, torch.bfloat16, max_shard_bytes=1 << 20)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert written["tensors"] == 5
    assert sorted(state) == ["embed_tokens.weight"] + [f"layers.{i}.weight" for i in range(4)]
    assert all(state[f"layers.{i}.weight"].eq(i).all() for i in range(4))


def test_our_code_unpickles_only_tensors():
    """Issue 59 (point 6): the files we write are read with torch.load(weights_only=True) (or
    JSON); DeepSpeed's own pickles load inside DeepSpeed, and the one our code opens itself (the
    universal conversion's common state, made by DeepSpeed from our checkpoint) says so where it
    does. The README asks for checkpoints from trusted storage for DeepSpeed's reading."""
    root = Path(__file__).parents[2] / "raytrain_cpu"
    unsafe = [
        f"{p.name}:{n}"
        for p in sorted(root.glob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if ("weights_only=False" in line or "pickle.load(" in line) and "DeepSpeed's own pickle" not in line
    ]
    assert unsafe == []
