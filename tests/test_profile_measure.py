"""Measured profiling on CPU with real megatron-core layers, and profile matching."""

from __future__ import annotations

import warnings

import pytest
import yaml

from megapipe.profile.format import load_profile, save_profile
from megapipe.errors import ConfigError, ProfileError
from megapipe.records import Profile
from megapipe.profile.match import ProfileDeviceWarning, match_profile, scale_profile
from megapipe.records import GpuSpec, LayerKind, ModelSpec, ParallelSpec, Recompute, TrainSpec

pytest.importorskip("megatron.core")

from megapipe.profile.measure import measure_profile  # noqa: E402

from megapipe.options import MeasureOptions

SEQ, MBS, HIDDEN, VOCAB = 128, 2, 64, 32768
FAST = MeasureOptions(device="cpu", warmup=1, iters=3, num_threads=1)


def _model(*, vocab_size: int = VOCAB, num_layers: int = 4) -> ModelSpec:
    return ModelSpec(
        name="tiny_llama", num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=172, vocab_size=vocab_size, seq_length=SEQ,
    )


def _decoder_params(model: ModelSpec) -> int:
    """SwiGLU, no biases, GQA: qkv + proj + fc1 (2 x ffn) + fc2 + two RMSNorm weights."""
    h, d = model.hidden_size, model.head_dim
    qkv = h * (model.num_attention_heads + 2 * model.num_query_groups) * d
    return qkv + model.num_attention_heads * d * h + 3 * h * model.ffn_hidden_size + 2 * h


@pytest.fixture(scope="module")
def profile() -> Profile:
    return measure_profile(
        model=_model(), train=TrainSpec(micro_batch_size=MBS, seq_length=SEQ),
        parallel=ParallelSpec(use_distributed_optimizer=False), options=FAST,
    )


@pytest.mark.engine
def test_profile_is_valid_and_round_trips(profile: Profile, tmp_path) -> None:
    path = tmp_path / "p.yaml"
    save_profile(profile, path)
    loaded = load_profile(path)
    assert loaded == profile
    kinds = [layer.kind for layer in loaded.layers]
    assert kinds == [LayerKind.embedding] + [LayerKind.decoder] * 4 + [LayerKind.loss]
    meta = dict(loaded.meta)
    assert meta["megatron_core_version"] and meta["torch_version"] and meta["date"]
    assert meta["decoder_replicated"].startswith("1 measured TransformerLayer")
    for key in ("embedding", "decoder", "loss"):
        low, high = (float(v) for v in meta[f"{key}.fwd_ms_p10_p90"].split(","))
        assert 0 < low <= high


@pytest.mark.engine
def test_large_vocabulary_head_costs_more_than_small_decoder_layer(profile: Profile) -> None:
    decoder, loss = profile.layers[1], profile.layers[-1]
    assert loss.fwd_ms + loss.bwd_ms > 2 * (decoder.fwd_ms + decoder.bwd_ms)
    # The loss unit keeps [s, b, vocab] logits-sized tensors, a decoder layer a few [s, b, h] ones.
    assert loss.act_bytes >= SEQ * MBS * VOCAB * 2
    assert loss.act_bytes > 10 * decoder.act_bytes


@pytest.mark.engine
def test_parameters_and_static_bytes_follow_megatron_shapes(profile: Profile) -> None:
    model = _model()
    embedding, decoder, loss = profile.layers[0], profile.layers[1], profile.layers[-1]
    assert embedding.param_count == VOCAB * HIDDEN
    assert decoder.param_count == _decoder_params(model)
    assert loss.param_count == VOCAB * HIDDEN + HIDDEN  # untied output layer + final RMSNorm
    for layer in profile.layers:
        assert layer.static_bytes == 18 * layer.param_count  # mixed-precision Adam, no distributed optimizer
        assert 0 <= layer.wgrad_ms <= layer.bwd_ms
    assert embedding.wgrad_ms == embedding.bwd_ms  # token ids have no gradient: all of backward is W


@pytest.mark.engine
def test_full_recompute_keeps_only_the_layer_input() -> None:
    """Korthikanti et al. 2022: full recompute stores 2 s b h bytes (bf16 layer input) per layer."""
    train = TrainSpec(micro_batch_size=MBS, seq_length=SEQ)
    plain, full = (
        measure_profile(
            model=_model(vocab_size=512, num_layers=1),
            train=TrainSpec(micro_batch_size=MBS, seq_length=SEQ, recompute_granularity=recompute),
            options=MeasureOptions(device="cpu", warmup=0, iters=1, num_threads=1),
        )
        for recompute in (Recompute.none, Recompute.full)
    )
    assert full.layers[1].act_bytes == 2 * train.seq_length * train.micro_batch_size * HIDDEN
    assert plain.layers[1].act_bytes > 10 * full.layers[1].act_bytes


def test_bad_options_raise_config_errors() -> None:
    with pytest.raises(ConfigError, match="iters"):
        MeasureOptions(iters=0)
    with pytest.raises(ConfigError, match="device"):
        MeasureOptions(device="tpu")
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=2"):
        measure_profile(model=_model(), train=TrainSpec(), parallel=ParallelSpec(tensor_model_parallel_size=2),
                        options=FAST)


def _gpu(name: str, tflops: float) -> GpuSpec:
    return GpuSpec(name=name, bf16_tflops=tflops, hbm_gbytes_per_s=3000.0, memory_gib=80.0)


@pytest.mark.engine
def test_match_rejects_other_shapes(profile: Profile) -> None:
    train = TrainSpec(micro_batch_size=MBS, seq_length=SEQ)
    assert match_profile(profile, model=_model(), train=train) is profile
    with pytest.raises(ProfileError, match="num_layers=8"):
        match_profile(profile, model=_model(num_layers=8), train=train)
    wider = ModelSpec(**{**{f: getattr(_model(), f) for f in ModelSpec.__slots__}, "hidden_size": 128})
    with pytest.raises(ProfileError, match="hidden_size=128"):
        match_profile(profile, model=wider)
    with pytest.raises(ProfileError, match="micro_batch_size=4"):
        match_profile(profile, model=_model(), train=TrainSpec(micro_batch_size=4, seq_length=SEQ))


@pytest.mark.engine
def test_match_scales_for_another_gpu(profile: Profile) -> None:
    with pytest.raises(ProfileError, match="time scale"):
        match_profile(profile, model=_model(), gpu=_gpu("h100_80gb", 989.0))
    scaled = match_profile(profile, model=_model(), gpu=_gpu("h100_80gb", 989.0), time_scale=2.5)
    assert scaled.layers[1].fwd_ms == pytest.approx(2.5 * profile.layers[1].fwd_ms)
    assert dict(scaled.meta)["time_scale"] == "2.5"
    on_a100 = Profile(layers=profile.layers, device="a100_80gb",
                      meta=(*profile.meta, ("gpu_bf16_tflops", "312")))
    with pytest.warns(ProfileDeviceWarning, match="a100_80gb"):
        faster = match_profile(on_a100, model=_model(), gpu=_gpu("h100_80gb", 989.0))
    assert faster.layers[-1].bwd_ms == pytest.approx(profile.layers[-1].bwd_ms * 312 / 989)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert match_profile(on_a100, model=_model(), gpu=_gpu("a100_80gb", 312.0)) is on_a100
    assert scale_profile(profile, 1.0).layers == profile.layers


CPU_RUN = ["model=tiny_gpt", "cluster=cpu_gloo", "parallel.pipeline_model_parallel_size=1",
           "parallel.tensor_model_parallel_size=1"]


@pytest.mark.engine
def test_cli_profile_then_calibrate(tmp_path, capsys) -> None:
    """`megapipe profile` writes a valid profile; `megapipe calibrate` fits it and writes a usable overlay."""
    from megapipe.cli import main
    from megapipe.config import compose, to_scenario

    code = main(["profile", *CPU_RUN, f"output.dir={tmp_path}", "output.format=json",
                 "extra={iters: 2, warmup: 0, num_threads: 1}"])
    assert code == 0
    written = load_profile(tmp_path / "profile.yaml")
    assert written.device == "cpu" and dict(written.meta)["gpu_bf16_tflops"] == "0.1"
    assert written.num_decoder_layers == 4
    assert not list(tmp_path.glob(".tmp-*"))  # atomic write leaves no temporary file
    code = main(["calibrate", str(tmp_path / "profile.yaml"), *CPU_RUN, f"output.dir={tmp_path}",
                 "output.format=json"])
    assert code == 0
    assert '"overlay"' in capsys.readouterr().out
    scenario = to_scenario(compose([*CPU_RUN, f"hydra.searchpath=[file://{tmp_path}]", "+calibration=cpu"]))
    fitted = yaml.safe_load((tmp_path / "calibration" / "cpu.yaml").read_text())["cluster"]["gpu"]
    assert scenario.cluster.gpu.kernel_overhead_us == fitted["kernel_overhead_us"]


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    from megapipe.cli import main

    assert main(["profile", *CPU_RUN, f"output.dir={tmp_path}", "extra={iterations: 3}"]) == 2
    assert "extra.iterations" in capsys.readouterr().err
    other = Profile(layers=_placeholder_layers(), device="h100_80gb")
    save_profile(other, tmp_path / "h100.yaml")
    assert main(["calibrate", str(tmp_path / "h100.yaml"), *CPU_RUN, f"output.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "h100_80gb" in err and "\n" not in err


def _placeholder_layers():
    from megapipe.records import LayerCost

    return (LayerCost(name="decoder.0", kind=LayerKind.decoder, fwd_ms=1.0, bwd_ms=2.0, wgrad_ms=1.0,
                      static_bytes=0.0, act_bytes=0.0),)
