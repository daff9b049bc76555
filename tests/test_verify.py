"""mxport verify: the pipeline on a tiny random Llama end to end, the CLI, prompts files, the embedded model
(slow)."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from mxport.cli import app
from mxport.prompts import BUILTIN_PROMPTS, load_prompts

KEYS = ("gen_kl_error_mean", "gen_kl_error_max", "token_mult_prob_error", "greedy_agreement", "tokens",
        "weight_sqnr_db_min", "weight_sqnr_db_mean")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mxport.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("verify") / "tiny", hidden=64, intermediate=96, layers=3,
                           dtype=torch.float32)


@pytest.fixture(scope="module")
def two_prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    p.write_text("# two prompts\nName a color.\n\nCount to three.\n")
    return p


def test_builtin_prompts_are_varied():
    assert len(BUILTIN_PROMPTS) >= 16 and len(set(BUILTIN_PROMPTS)) == len(BUILTIN_PROMPTS)
    convs = load_prompts()
    assert len(convs) == len(BUILTIN_PROMPTS)
    assert convs[0] == [{"role": "user", "content": BUILTIN_PROMPTS[0]}]


def test_prompts_file_formats(tmp_path, two_prompts):
    assert [c[0]["content"] for c in load_prompts(two_prompts)] == ["Name a color.", "Count to three."]
    j = tmp_path / "p.json"
    j.write_text(json.dumps(["hi", [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "yo"}]]))
    convs = load_prompts(j)
    assert convs[0] == [{"role": "user", "content": "hi"}] and convs[1][0]["role"] == "system"
    j.write_text(json.dumps([3]))
    with pytest.raises(ValueError, match="string or a list"):
        load_prompts(j)
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no prompt"):
        load_prompts(tmp_path / "empty.txt")
    with pytest.raises(FileNotFoundError):
        load_prompts(tmp_path / "missing.txt")


def test_cli_verify_tiny_model_json(tiny, tmp_path):
    out = tmp_path / "v.json"
    res = CliRunner().invoke(app, ["verify", str(tiny), "--max-new-tokens", "4", "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    for k in KEYS:
        assert k in r and isinstance(r[k], (int, float)) and math.isfinite(r[k]), k
    # the tiny model's byte tokenizer never emits EOS early
    assert r["tokens"] == sum(1 for _ in range(18)) * 4
    assert 0 < r["gen_kl_error_mean"] <= r["gen_kl_error_max"]
    assert r["token_mult_prob_error"] >= 1.0 and 0.0 <= r["greedy_agreement"] <= 1.0
    assert r["mxfp8_layers"] == 3 * 7 and len(r["weight_sqnr_db"]) == 21
    assert r["weight_sqnr_db_min"] <= r["weight_sqnr_db_mean"]
    # E4M3 on Gaussian weights: ~31 dB (3 mantissa bits + block scale)
    assert 25 < r["weight_sqnr_db_mean"] < 40
    assert r["passed"] is True


def test_cli_verify_max_kl_exit_code_and_bad_input(tiny, two_prompts):
    runner = CliRunner()
    args = ["verify", str(tiny), "--prompts", str(two_prompts), "--max-new-tokens", "2"]
    res = runner.invoke(app, [*args, "--max-kl", "0", "--json", "-"])
    assert res.exit_code == 1, res.output
    assert runner.invoke(app, [*args, "--max-kl", "1e6"]).exit_code == 0
    assert runner.invoke(app, [*args, "--activation", "int8"]).exit_code == 2
    assert runner.invoke(app, [*args, "--fp8-dtype", "e3m4"]).exit_code == 2
    assert runner.invoke(app, [*args, "--target-kl", "0.1"]).exit_code == 2
    assert runner.invoke(app, ["verify", str(tiny / "nope")]).exit_code == 2


def test_verify_e5m2_and_w8a8_drift_more_than_e4m3_weight_only(tiny, two_prompts):
    from mxport.verify import verify

    base = verify(str(tiny), prompts=two_prompts, max_new_tokens=4)
    e5 = verify(str(tiny), prompts=two_prompts, max_new_tokens=4, fp8_dtype="e5m2")
    w8a8 = verify(str(tiny), prompts=two_prompts, max_new_tokens=4, activation="mxfp8")
    assert e5["fp8_dtype"] == "e5m2" and w8a8["activation"] == "mxfp8"
    # E5M2 has 2 mantissa bits to E4M3's 3: about 6 dB less weight SQNR
    assert 4 < base["weight_sqnr_db_mean"] - e5["weight_sqnr_db_mean"] < 8
    assert w8a8["weight_sqnr_db_mean"] == base["weight_sqnr_db_mean"]
    assert w8a8["gen_kl_error_mean"] > base["gen_kl_error_mean"]


def test_per_layer_sweep_and_keep_all_reaches_zero(tiny, two_prompts):
    from mxport.verify import verify

    r = verify(str(tiny), prompts=two_prompts, max_new_tokens=3, per_layer=True, target_kl=0.0)
    pl = r["per_layer"]
    assert [row["layer"] for row in pl["layers"]] == [0, 1, 2]
    assert sum(row["share"] for row in pl["layers"]) == pytest.approx(1.0)
    assert all(row["gen_kl_error_mean"] > 0 for row in pl["layers"])
    s = pl["suggestion"]
    # target 0 is met only with every layer kept: then both models run the same modules, KL exactly 0
    assert s["keep_layers"] == [0, 1, 2] and s["met"] and s["gen_kl_error_mean"] == 0.0
    assert s["exclude"] == ["model.layers.0.*", "model.layers.1.*", "model.layers.2.*"]
    # the greedy order follows the shares: the first kept layer has the largest share
    first = s["steps"][1]["keep_layers"][0]
    assert first == max(pl["layers"], key=lambda row: row["share"])["layer"]
    assert s["steps"][0]["gen_kl_error_mean"] == r["gen_kl_error_mean"]


def test_per_layer_target_met_early(tiny, two_prompts):
    from mxport.verify import verify

    full = verify(str(tiny), prompts=two_prompts, max_new_tokens=3)["gen_kl_error_mean"]
    r = verify(str(tiny), prompts=two_prompts, max_new_tokens=3, per_layer=True, target_kl=full * 0.9)
    s = r["per_layer"]["suggestion"]
    assert s["met"] and 1 <= len(s["keep_layers"]) < 3 and s["gen_kl_error_mean"] <= full * 0.9


def test_verify_from_checkpoint_matches_quantize_path(tiny, two_prompts, tmp_path):
    from test_nn import _write_checkpoint

    from mxport.verify import verify

    ckpt = _write_checkpoint(tiny, tmp_path / "ck", "modelopt")
    direct = verify(str(tiny), prompts=two_prompts, max_new_tokens=4)
    loaded = verify(str(tiny), prompts=two_prompts, max_new_tokens=4, checkpoint=ckpt)
    for k in KEYS:
        assert loaded[k] == direct[k], k
    assert loaded["checkpoint"] == str(ckpt)


@pytest.mark.slow
def test_verify_embedded_model_small_budget(tmp_path, two_prompts):
    out = tmp_path / "v.json"
    res = CliRunner().invoke(app, ["verify", "--prompts", str(two_prompts), "--max-new-tokens", "8", "--json",
                                   str(out), "--max-kl", "0.5"])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    for k in KEYS:
        assert math.isfinite(r[k]), k
    assert r["model"] == "SmolLM2-135M-Instruct"
    assert r["mxfp8_layers"] == 30 * 7
    assert 0 < r["gen_kl_error_mean"] < 0.5 and r["greedy_agreement"] > 0.5
    assert 0 < r["tokens"] <= 16


def test_cli_exclude_keeps_layers_in_high_precision(tiny, two_prompts, tmp_path):
    out = tmp_path / "v.json"
    args = ["verify", str(tiny), "--prompts", str(two_prompts), "--max-new-tokens", "2", "--json", str(out)]
    res = CliRunner().invoke(app, [*args, "--exclude", "model.layers.0.*", "--exclude", "*.mlp.*"])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert sorted(r["weight_sqnr_db"]) == [f"model.layers.{i}.self_attn.{p}_proj"
                                           for i in (1, 2) for p in "koqv"]
    assert CliRunner().invoke(app, [*args, "--exclude", "*"]).exit_code == 2  # nothing left to verify


def test_failed_checks_gate_on_finite_figures():
    from mxport.verify import failed_checks

    ok = {"gen_kl_error_mean": 0.01, "gen_kl_error_max": 0.1, "token_mult_prob_error": 1.02,
          "greedy_agreement": 0.9}
    assert failed_checks(ok, None) == [] and failed_checks(ok, 0.01) == []
    assert failed_checks(ok, 0.005) == ["gen_kl_error_mean 0.01 exceeds max_kl 0.005"]
    nan = dict(ok, gen_kl_error_mean=math.nan, gen_kl_error_max=math.nan)
    assert failed_checks(nan, 1e6) == ["gen_kl_error_mean is nan (not a finite number)",
                                       "gen_kl_error_max is nan (not a finite number)"]
    assert failed_checks(nan, None) == failed_checks(nan, 1e6)
    assert failed_checks(dict(ok, gen_kl_error_max=math.inf), None) == [
        "gen_kl_error_max is inf (not a finite number)"]
    assert failed_checks(dict(ok, greedy_agreement=math.nan), None) == [
        "greedy_agreement is nan (not a finite number)"]


def test_cli_verify_nan_scales_checkpoint_is_refused(tiny, two_prompts, tmp_path):
    """A checkpoint whose scales are all E8M0 NaN (255) decodes to NaN weights. It used to pass verify (NaN KL
    terms summed to 0); now the reader refuses it before any figure is computed: one line naming the tensor,
    exit 2 (bad input), even with a huge --max-kl."""
    from safetensors.torch import load_file, save_file
    from test_nn import _write_checkpoint

    ckpt = _write_checkpoint(tiny, tmp_path / "ck", "modelopt")
    path = ckpt / "model.safetensors"
    state = load_file(str(path))
    scales = [n for n in state if n.endswith("weight_scale")]
    assert scales
    for n in scales:
        state[n] = torch.full_like(state[n], 255)
    save_file(state, str(path), metadata={"format": "pt"})
    res = CliRunner().invoke(app, ["verify", str(tiny), "--checkpoint", str(ckpt), "--prompts",
                                   str(two_prompts), "--max-new-tokens", "2", "--max-kl", "1e6"])
    assert res.exit_code == 2, res.output
    assert "NaN scale byte(s) (E = 255)" in res.output and "Traceback" not in res.output


def test_cli_verify_nan_figures_fail_the_check(tiny, two_prompts, tmp_path):
    """Non-finite figures are a failed check (exit 1) with or without --max-kl: a model with a NaN weight
    gives NaN log-probs, whose KL used to sum to 0.0 and pass."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "nan-model"
    shutil.copytree(tiny, bad)
    path = bad / "model.safetensors"
    state = load_file(str(path))
    norm = next(n for n in state if n.endswith("norm.weight"))
    state[norm] = torch.full_like(state[norm], float("nan"))
    save_file(state, str(path), metadata={"format": "pt"})
    out = tmp_path / "v.json"
    res = CliRunner().invoke(app, ["verify", str(bad), "--prompts", str(two_prompts), "--max-new-tokens", "2",
                                   "--max-kl", "1e6", "--json", str(out)])
    assert res.exit_code == 1, res.output
    r = json.loads(out.read_text())
    assert r["passed"] is False
    assert "gen_kl_error_mean is nan (not a finite number)" in r["failures"]


def test_cli_verify_bad_device_is_one_line_before_loading(tiny, two_prompts):
    """A device that does not exist here (an unknown type, CUDA without CUDA) is a usage error named in one
    line, exit 2, before the model is loaded; it used to be a traceback with exit 1 after loading it."""
    for device in ("tpu", "cuda:7"):
        res = CliRunner().invoke(app, ["verify", str(tiny), "--prompts", str(two_prompts), "--device",
                                       device])
        assert res.exit_code == 2, res.output
        assert f"device {device!r}" in res.output and "Traceback" not in res.output


@pytest.fixture(scope="module")
def no_tokenizer(tiny, tmp_path_factory):
    """The tiny model as a trainer's checkpoint often is: weights and config, no tokenizer files."""
    import shutil

    from mxport.models import TOKENIZER_FILES

    path = tmp_path_factory.mktemp("notok") / "tiny"
    shutil.copytree(tiny, path, ignore=shutil.ignore_patterns(*TOKENIZER_FILES, "*.jinja"))
    return path


def test_cli_verify_without_a_tokenizer_draws_prompts_from_the_vocabulary(no_tokenizer):
    """A model folder without tokenizer files ended in "install sentencepiece": it works, its prompts drawn
    from the vocabulary with a fixed seed (the same report twice), and the output says so in one line."""
    from mxport.models import vocabulary_prompts_note

    note = vocabulary_prompts_note(no_tokenizer, len(BUILTIN_PROMPTS))
    assert note == (f"no tokenizer in {no_tokenizer}: prompts are {len(BUILTIN_PROMPTS)} x 16 token ids "
                    "drawn from the vocabulary (seed 0)")
    res = CliRunner().invoke(app, ["verify", str(no_tokenizer), "--max-new-tokens", "2"])
    assert res.exit_code == 0, res.output
    assert note in res.stdout.splitlines()
    runs = [CliRunner().invoke(app, ["verify", str(no_tokenizer), "--max-new-tokens", "2", "--json", "-"])
            for _ in range(2)]
    reports = [json.loads(r.stdout) for r in runs]
    assert reports[0]["prompt_note"] == note and reports[0]["samples"] == reports[1]["samples"]
    assert reports[0]["samples"][0]["prompt"].startswith("token ids [")


def test_verify_without_a_tokenizer_refuses_a_prompts_file(no_tokenizer, two_prompts):
    res = CliRunner().invoke(app, ["verify", str(no_tokenizer), "--prompts", str(two_prompts)])
    assert res.exit_code == 2
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"error: no tokenizer in {no_tokenizer}: a prompts file needs one")


def test_vocabulary_prompts_are_seeded_and_in_range():
    from mxport.models import vocabulary_prompts

    a = vocabulary_prompts(50, 3, length=7, seed=5)
    assert a.shape == (3, 7) and a.dtype == torch.long and 0 <= int(a.min()) and int(a.max()) < 50
    assert torch.equal(a, vocabulary_prompts(50, 3, length=7, seed=5))
    assert not torch.equal(a, vocabulary_prompts(50, 3, length=7, seed=6))
    with pytest.raises(ValueError):
        vocabulary_prompts(0)


def test_verify_fp4_twins_beside_mxfp8_on_the_same_prompts(tiny, two_prompts, tmp_path):
    """--quant mxfp4 / nvfp4: the same tensors as MXFP8's twin, decoded from mxport.fp4 in place (each weight
    equal to quantize_fp4 -> dequantize of the source's), scored on the same prompts; 4-bit drifts further."""
    from mxport.fp4 import quantize_fp4
    from mxport.verify import build_fp4_twin, verify

    reports = {q: verify(str(tiny), prompts=two_prompts, max_new_tokens=4, quant=q)
               for q in ("mxfp8", "mxfp4", "nvfp4")}
    for q, r in reports.items():
        assert r["quant"] == q and r["quantized_tensors"] == 21 and r["tokens"] == 2 * 4
        assert sorted(r["weight_sqnr_db"]) == sorted(reports["mxfp8"]["weight_sqnr_db"])
    assert reports["nvfp4"]["element"] == "e2m1" and reports["nvfp4"]["fp8_dtype"] is None
    assert reports["nvfp4"]["mxfp8_layers"] == 0 and reports["mxfp8"]["element"] == "e4m3"
    assert "nvfp4_output" in reports["nvfp4"]["samples"][0]
    assert "mxfp8_output" in reports["mxfp8"]["samples"][0]
    for q in ("mxfp4", "nvfp4"):  # E2M1 on Gaussian weights: ~20 dB against E4M3's ~31
        assert reports[q]["weight_sqnr_db_mean"] < reports["mxfp8"]["weight_sqnr_db_mean"] - 5
        assert reports[q]["gen_kl_error_mean"] > reports["mxfp8"]["gen_kl_error_mean"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    twin, sqnr = build_fp4_twin(model, "nvfp4")
    w = model.model.layers[1].mlp.down_proj.weight
    got = twin.model.layers[1].mlp.down_proj.weight
    assert torch.equal(got, quantize_fp4(w.detach(), "nvfp4").dequantize(torch.float32))
    assert torch.equal(twin.model.embed_tokens.weight, model.model.embed_tokens.weight)  # kept (as MXFP8)
    assert sqnr == reports["nvfp4"]["weight_sqnr_db"]


def test_verify_fp4_refusals(tiny, tmp_path):
    from mxport.verify import verify

    for kwargs, match in (({"quant": "fp4"}, "quant must be one of"),
                          ({"quant": "nvfp4", "per_layer": True}, "per-layer"),
                          ({"quant": "mxfp4", "activation": "mxfp8"}, "activation"),
                          ({"quant": "nvfp4", "checkpoint": str(tmp_path)}, "checkpoint"),
                          ({"quant": "nvfp4", "fp8_dtype": "e5m2"}, "FP8 element type")):
        with pytest.raises(ValueError, match=match):
            verify(str(tiny), max_new_tokens=1, **kwargs)
    res = CliRunner().invoke(app, ["verify", str(tiny), "--quant", "nvfp4", "--per-layer"])
    assert res.exit_code == 2 and "per-layer sweep" in res.output
