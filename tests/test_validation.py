"""The measured-runs data set, the run predictor, the runtime fit and ``megapipe validate``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from megapipe.config import compose, to_scenario
from megapipe.errors import ConfigError
from megapipe.validation.runs import PUBLIC_RUNS, read_runs
from megapipe.records import RuntimeSpec
from megapipe.validation.fit import fit_stages, stages_of, RunSet, fit_indices, fit_runtime, leave_one_out, with_values
from megapipe.validation.predict import predict, resolve, run_cluster
from megapipe.validation.runs import RUNS_FORMAT, runs_from_document

RESERVED = ("korthikanti", "narayanan", "bridge performance", "dgxc")


def _public() -> dict:
    with open(PUBLIC_RUNS, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def _clusters(runs):
    found = {}
    for run in runs:
        if run.cluster not in found:
            found[run.cluster] = to_scenario(compose([f"cluster={run.cluster}", "parallel.tensor_model_parallel_size=1",
                                                      "parallel.pipeline_model_parallel_size=1"])).cluster
    return [found[run.cluster] for run in runs]


def test_public_runs_parse_and_hold_what_each_run_needs():
    runs = read_runs()
    assert len(runs) >= 50
    assert {run.precision for run in runs} == {"bf16", "fp8"}
    assert len({run.cluster for run in runs}) >= 4
    for run in runs:
        par = run.parallel
        assert par.world_size == run.num_gpus
        assert run.step_time_s > 0 and run.source.startswith("http") and run.how in ("measured", "converted")
        assert set(run.unknown) <= {"micro_batch_size", "virtual_pipeline_model_parallel_size", "sequence_parallel",
                                    "recompute_granularity"}
        text = " ".join([run.set, run.source, *run.assumptions]).lower()
        assert not any(word in text for word in RESERVED), run.id


def test_bad_runs_get_one_error_naming_the_run_and_the_field():
    document = _public()
    with pytest.raises(ConfigError, match=RUNS_FORMAT):
        runs_from_document({"runs": []})
    first = next(run for run in document["runs"] if run["parallel"]["tensor_model_parallel_size"] == 2)
    broken = {**first, "num_gpus": first["num_gpus"] + 1}
    with pytest.raises(ConfigError, match=rf"{first['id']}.*num_gpus=.*not divisible"):
        runs_from_document({"format": RUNS_FORMAT, "runs": [broken]})
    unstated = {**first, "unknown": [], "train": {**first["train"], "micro_batch_size": None}}
    with pytest.raises(ConfigError, match="null but not listed in unknown"):
        runs_from_document({"format": RUNS_FORMAT, "runs": [unstated]})
    with pytest.raises(ConfigError, match="appear more than once"):
        runs_from_document({"format": RUNS_FORMAT, "runs": [first, first]})
    odd = {**first, "model": {**first["model"], "activation": "relu6"}}
    with pytest.raises(ConfigError, match="activation='relu6' is unknown"):
        runs_from_document({"format": RUNS_FORMAT, "runs": [odd]})


def test_runs_state_layouts_and_memory_settings_as_their_sources_ran_them():
    """A stated layout sets the interleaving depth and is what the prediction splits by; the memory settings
    (precision-aware optimizer, offloading, Megatron FSDP) reach the records; a layout of the wrong stage count is
    refused."""
    runs = {run.id: run for run in read_runs()}
    recipe = runs["mlm_recipe_deepseek_v3_gb200_mxfp8_256gpu_tp1pp4ep64"]
    assert recipe.layout == "Et*4|(tttt|)*14tmL" and recipe.parallel.virtual_pipeline_model_parallel_size == 4
    assert (recipe.train.exp_avg_dtype, recipe.train.offload_optimizer_states) == ("bf16", True)
    assert recipe.parallel.features.offload_modules == ("expert_fc1",)
    fsdp = runs["nemo2504_fp8cs_gb200_llama3_70b_64gpu"].parallel
    assert fsdp.use_megatron_fsdp and fsdp.data_parallel_sharding_strategy == "optim_grads_params"
    document = _public()
    node = next(run for run in document["runs"] if run["id"] == recipe.id)
    bad = {**node, "parallel": {**node["parallel"], "virtual_pipeline_model_parallel_size": 2}}
    with pytest.raises(ConfigError, match="16 stages, not PP x VP = 4 x 2"):
        runs_from_document({"format": RUNS_FORMAT, "runs": [bad]})


@pytest.mark.slow
def test_public_runs_fit_megapipes_memory_model_but_the_one_documented():
    """Every published run fits as it ran, but Llama 3 405B on 8,192 H100 (docs/validation.md says why)."""
    runs = read_runs()
    over = {run.id for run, base in zip(runs, _clusters(runs)) if not resolve(run, base).fits}
    assert over == {"llama3_405b_8192gpu_seq8192"}


def _subset(ids):
    runs = [run for run in read_runs() if run.id in ids]
    assert len(runs) == len(ids)
    return runs


SUBSET = ("mlm_readme_h100_gpt7.1b", "mlm_readme_h100_gpt16b", "nemo2407_fp8_h100_llama3_70b_64gpu",
          "nemo2407_fp8_h100_llama2_13b_16gpu", "megascale_megatronlm_175b_256gpu", "nemo_longseq_fp8_b200_llama3_8b_8k",
          "nemo_longseq_fp8_b200_llama3_8b_128k", "nemo2407_fp8_h100_nemotron_8b_64gpu")


def test_resolve_keeps_stated_settings_and_chooses_only_the_unstated():
    runs = _subset(SUBSET)
    for run, base in zip(runs, _clusters(runs)):
        resolved = resolve(run, base)
        assert {name for name, _ in resolved.chosen} == set(run.unknown)
        par = resolved.parallel
        assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size,
                par.data_parallel_size) == (run.parallel.tensor_model_parallel_size,
                                            run.parallel.pipeline_model_parallel_size,
                                            run.parallel.context_parallel_size, run.parallel.data_parallel_size)
        if "micro_batch_size" not in run.unknown:
            assert resolved.train.micro_batch_size == run.train.micro_batch_size
        plan = predict(resolved, run_cluster(run, base))
        assert plan.step_time_s > 0
        assert sum(ms for _, ms in plan.breakdown) == pytest.approx(plan.step_time_s * 1e3, rel=1e-9)


def test_fit_recovers_a_runtime_that_generated_the_step_times():
    """Step times made by the model with a known runtime: the fit from the uncalibrated start finds it again."""
    runs = _subset(SUBSET)
    clusters = _clusters(runs)
    resolved = [resolve(run, base) for run, base in zip(runs, clusters)]
    truth = with_values(RuntimeSpec(), {"gemm_efficiency_scale.hopper": 0.8, "gemm_efficiency_scale.ampere": 0.7,
                                        "gemm_efficiency_scale.blackwell": 0.85,
                                        "attention_efficiency_scale.hopper": 0.75,
                                        "attention_efficiency_scale.blackwell": 0.9, "step_overhead_ms": 60.0})
    made = RunSet(resolved, clusters)
    times = made.step_times(truth, range(len(runs)))
    synthetic = [dataclasses.replace(item, run=dataclasses.replace(item.run, step_time_s=float(t)))
                 for item, t in zip(resolved, times)]
    fitted = fit_runtime(RunSet(synthetic, clusters), start=RuntimeSpec()).runtime
    for arch, value in truth.gemm_efficiency_by_architecture:
        assert fitted.gemm_scale(arch) == pytest.approx(value, rel=1e-3)
    for arch, value in truth.attention_efficiency_by_architecture:
        assert fitted.attention_scale(arch) == pytest.approx(value, rel=1e-2)
    assert fitted.step_overhead_ms == pytest.approx(60.0, rel=5e-2)
    loo = leave_one_out(RunSet(synthetic, clusters), start=fitted)
    assert max(abs(p / t - 1) for p, t in zip(loo, times)) < 2e-3


def test_validate_command_writes_the_table_and_a_runtime_file(tmp_path, capsys):
    from megapipe.cli import main

    docs = tmp_path / "validation.md"
    docs.write_text("intro\n<!-- megapipe validate: begin -->\nold\n<!-- megapipe validate: end -->\noutro\n")
    ids = ",".join(SUBSET)
    code = main(["validate", f"output.dir={tmp_path / 'out'}", f"validate.ids=[{ids}]", f"validate.docs={docs}",
                 "output.format=json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(result["runs"]) == len(SUBSET)
    for row in result["runs"]:
        assert row["loo_error"] is not None and abs(row["error"]) < 1.0
        assert row["predicted_step_time_s"] > 0 and row["breakdown_ms"]
    text = docs.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text
    assert "| mlm_readme_h100_gpt7.1b |" in text and "LOO" in text
    runtime = yaml.safe_load((tmp_path / "out" / "runtime.yaml").read_text())
    assert runtime["name"] == "megatron_core" and set(runtime["gemm_efficiency_by_architecture"]) >= {"hopper"}
    # The written runtime file is a runtime option: it composes and plans.
    conf = tmp_path / "conf" / "runtime"
    conf.mkdir(parents=True)
    (conf / "fitted.yaml").write_text((tmp_path / "out" / "runtime.yaml").read_text())
    scenario = to_scenario(compose([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "runtime=fitted"]))
    assert scenario.cluster.runtime.gemm_scale("hopper") == pytest.approx(
        runtime["gemm_efficiency_by_architecture"]["hopper"])


def test_validate_rejects_bad_input_in_one_line(tmp_path, capsys):
    from megapipe.cli import main

    assert main(["validate", f"output.dir={tmp_path}", "validate.ids=[no_such_run]"]) == 2
    assert "validate.ids names ['no_such_run']" in capsys.readouterr().err
    assert main(["validate", f"output.dir={tmp_path}", "validate.fit=[gemm_efficiency_scale.tpu]"]) == 2
    assert "validate.fit names" in capsys.readouterr().err
    missing = tmp_path / "none.yaml"
    assert main(["validate", str(missing), f"output.dir={tmp_path}"]) == 2
    assert "none.yaml" in capsys.readouterr().err


def test_committed_runtime_is_the_fit_on_the_public_runs():
    """hydra_conf/runtime/megatron_core.yaml holds the fit that `megapipe validate` reports (to 1%: the optimum is
    flat along some directions, and the file keeps 4 digits)."""
    runs = read_runs()
    clusters = _clusters(runs)
    committed = to_scenario(compose([])).cluster.runtime
    resolved = [resolve(run, base) for run, base in zip(runs, clusters)]
    fitted = fit_stages(RunSet(resolved, clusters), start=committed, stages=stages_of(resolved), max_iter=3)
    for arch, value in committed.gemm_efficiency_by_architecture:
        assert fitted.gemm_scale(arch) == pytest.approx(value, rel=1e-2)
    for arch, value in committed.attention_efficiency_by_architecture:
        assert fitted.attention_scale(arch) == pytest.approx(value, rel=1e-2)
    assert fitted.step_overhead_ms == pytest.approx(committed.step_overhead_ms, rel=1e-2)
    for cpu in ("x86", "grace"):  # the MoE stage: host time per kernel and dropless imbalance
        assert fitted.host_kernel(cpu) == pytest.approx(committed.host_kernel(cpu), rel=2e-2)
    assert fitted.moe_dropless_imbalance == pytest.approx(committed.moe_dropless_imbalance, rel=2e-2)
    assert committed.step_time_intervals, "megapipe validate writes the leave-one-source-out intervals"


def test_a_fit_prices_each_run_on_the_runtime_as_it_reads_it():
    """RunSet.step_time_s prices a run on its generation's scales, its host CPU's kernel cost and no step overhead,
    then adds the overhead, and re-prices a fixed split without partitioning it again: the same seconds, to the
    bit, as predicting on the whole runtime, for every public run; a runtime that differs only in another
    generation's scale or the overhead is not priced again."""
    from megapipe.validation.predict import predict_step_s

    runs = read_runs()
    clusters = _clusters(runs)
    resolved = [resolve(run, base) for run, base in zip(runs, clusters)]
    runtime = with_values(RuntimeSpec(), {"gemm_efficiency_scale.hopper": 0.8, "gemm_efficiency_scale.ampere": 0.7,
                                          "gemm_efficiency_scale.blackwell": 0.85, "host_kernel_us.grace": 60.0,
                                          "attention_efficiency_scale.hopper": 0.75, "step_overhead_ms": 61.5,
                                          "moe_dropless_imbalance": 1.2})
    priced = RunSet(resolved, clusters)
    again = with_values(runtime, {"gemm_efficiency_scale.hopper": 0.82, "gemm_efficiency_scale.blackwell": 0.8,
                                  "gemm_efficiency_scale.ampere": 0.72, "host_kernel_us.grace": 50.0})
    for index, item in enumerate(resolved):  # the second price reuses the run's split when it is fixed
        for each in (runtime, again):
            whole = predict_step_s(item, run_cluster(item.run, clusters[index], each))
            assert priced.step_time_s(index, each) == whole, item.run.id
    elsewhere = with_values(runtime, {"gemm_efficiency_scale.ampere": 0.6, "step_overhead_ms": 70.0})
    hopper = [index for index, item in enumerate(resolved) if clusters[index].gpu.architecture == "hopper"]
    before = sum(len(cache) for cache in priced._parts)
    for index in hopper:
        priced.step_time_s(index, elsewhere)
    assert sum(len(cache) for cache in priced._parts) == before
