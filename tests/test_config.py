"""Real Hydra composition of the shipped config groups, and the config -> records boundary."""

import json
import os

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError

from megapipe.config import compose, conf_dir, to_scenario
from megapipe.errors import ConfigError
from megapipe.records import Activation, AttentionBackend, Recompute

REQUIRED_MODELS = ("llama3_8b", "llama3_70b", "llama3_405b", "gpt3_175b", "gpt_48l_128k")
REQUIRED_CLUSTERS = ("h100_80gb", "h200_141gb", "b300_192gb", "a100_80gb", "mi300x_192gb", "mixed_h100_a100")


def test_defaults_are_the_writeups_70b_scenario():
    scenario = to_scenario(compose())
    assert scenario.model.name == "llama3_70b"
    assert scenario.cluster.num_gpus == 128 and scenario.cluster.gpus_per_node == 8
    assert scenario.train.seq_length == 8192
    assert scenario.train.global_batch_size * scenario.train.seq_length == pytest.approx(2.1e6, rel=0.01)
    # Null search dimensions fall back to the write-ups' TP=4, PP=8, DP=4.
    assert (scenario.parallel.tensor_model_parallel_size, scenario.parallel.pipeline_model_parallel_size,
            scenario.parallel.data_parallel_size) == (4, 8, 4)
    assert dict(scenario.fixed) == {}
    assert scenario.num_microbatches == 256 // (1 * 4)


@pytest.mark.parametrize("name", REQUIRED_MODELS)
def test_every_required_model_composes(name):
    model = to_scenario(compose([f"model={name}"])).model
    assert model.num_layers > 0 and model.num_attention_heads % model.num_query_groups == 0
    assert model.attention_backend in tuple(AttentionBackend)


def test_the_writeups_48_layer_gpt():
    model = to_scenario(compose(["model=gpt_48l_128k"])).model
    assert (model.num_layers, model.num_attention_heads) == (48, 16)
    assert model.vocab_size >= 128_000


@pytest.mark.parametrize("name", REQUIRED_CLUSTERS)
def test_every_required_cluster_composes(name):
    cluster = to_scenario(compose([f"cluster={name}", "parallel.tensor_model_parallel_size=1",
                                   "parallel.pipeline_model_parallel_size=1"])).cluster
    assert cluster.num_gpus > 0 and cluster.price_per_gpu_hour > 0
    for group in cluster.node_groups:
        assert 0 < group.gpu.usable_memory_fraction <= 1 and group.gpu.memory_gib > 0


def test_mixed_cluster_has_two_gpu_types():
    cluster = to_scenario(compose(["cluster=mixed_h100_a100", "parallel.tensor_model_parallel_size=1",
                                   "parallel.pipeline_model_parallel_size=1"])).cluster
    assert cluster.is_heterogeneous and len(cluster.node_groups) == 2


def test_typo_key_is_hydras_error():
    with pytest.raises((ConfigCompositionException, ConfigKeyError), match="num_layerz"):
        compose(["model.num_layerz=3"])


def test_unknown_model_is_hydras_error():
    with pytest.raises(Exception, match="llama9"):
        compose(["model=llama9"])


def test_overrides_fix_search_dimensions():
    scenario = to_scenario(compose(["parallel.tensor_model_parallel_size=8", "train.micro_batch_size=2",
                                    "schedule=zb_h1", "train.recompute_granularity=selective"]))
    assert set(scenario.fixed) == {"tensor_model_parallel_size", "micro_batch_size", "schedule",
                                   "recompute_granularity"}
    assert scenario.schedule == "zb_h1" and scenario.train.recompute_granularity is Recompute.selective
    assert scenario.parallel.data_parallel_size == 128 // (8 * 8)


def test_indivisible_gpu_count_is_a_config_error():
    with pytest.raises(ConfigError, match=r"parallel.tensor_model_parallel_size=3 .*does not divide the cluster's 128 "
                                          r"GPUs .*one of 1, 2, 4, 8"):
        to_scenario(compose(["parallel.tensor_model_parallel_size=3"]))


def test_indivisible_global_batch_is_a_config_error():
    with pytest.raises(ConfigError, match="global_batch_size=100"):
        to_scenario(compose(["train.global_batch_size=100", "train.micro_batch_size=8"]))


def test_hf_config_json(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 8192, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
    }
    path = tmp_path / "Meta-Llama-3-8B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="max_position_embeddings=8192 is the longest context"):
        to_scenario(compose(["model=hf", f"model.config_path={path}"]))
    scenario = to_scenario(compose(["model=hf", f"model.config_path={path}", "train.seq_length=4096"]))
    model = scenario.model
    assert scenario.train.seq_length == 4096 and scenario.seq_length_source == "train.seq_length"
    assert model.max_position_embeddings == 8192
    assert (model.num_layers, model.hidden_size, model.num_query_groups, model.ffn_hidden_size) == (32, 4096, 8, 14336)
    assert model.activation is Activation.swiglu and model.untie_embeddings_and_output_weights
    assert model.vocab_size == 128256 and model.name == "llama"  # from architectures, not the folder
    # A value on the command line wins over the file's.
    assert to_scenario(compose(["model=hf", f"model.config_path={path}", "model.num_layers=4",
                                "train.seq_length=4096"])).model.num_layers == 4


def test_hf_without_path_or_with_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="config_path"):
        to_scenario(compose(["model=hf"]))
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        to_scenario(compose(["model=hf", f"model.config_path={bad}"]))


def test_user_searchpath_adds_groups(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "my_model.yaml").write_text(
        "defaults: [base_model, _self_]\nname: my_model\nnum_layers: 6\nhidden_size: 256\n"
        "num_attention_heads: 4\nnum_query_groups: 4\nffn_hidden_size: 1024\nvocab_size: 1000\nseq_length: 512\n"
    )
    cfg = compose(["model=my_model", f"hydra.searchpath=[file://{tmp_path}]"])
    assert to_scenario(cfg).model.num_layers == 6


def test_conf_dir_is_shipped_with_the_package():
    assert os.path.isfile(os.path.join(conf_dir(), "config.yaml"))


def test_fp8_needs_fp8_tensor_cores_and_a_recipe_the_gpu_has():
    with pytest.raises(ConfigError, match="fp8 needs FP8 tensor cores, which cluster.gpu 'a100_80gb' lacks"):
        to_scenario(compose(["cluster=a100_80gb", "train.precision=fp8"]))
    with pytest.raises(ConfigError, match="mxfp8 needs Blackwell"):
        to_scenario(compose(["train.precision=fp8", "train.fp8_recipe=mxfp8"]))
    with pytest.raises(ConfigError, match="need train.precision=fp8"):
        to_scenario(compose(["train.fp8_recipe=delayed"]))
    with pytest.raises(ConfigError, match="fp8_param_gather=true needs parallel.use_distributed_optimizer"):
        to_scenario(compose(["train.precision=fp8", "train.fp8_param_gather=true",
                             "parallel.use_distributed_optimizer=false"]))
    hopper = to_scenario(compose(["train.precision=fp8"])).train
    assert (hopper.fp8_recipe, hopper.fp8_param_gather) == ("tensorwise", True)
    blackwell = to_scenario(compose(["cluster=b200_192gb", "train.precision=fp8"])).train
    assert blackwell.fp8_recipe == "mxfp8"
    blockwise = to_scenario(compose(["train.precision=fp8", "train.fp8_recipe=blockwise"])).train
    assert blockwise.fp8_param_gather is False


def test_runtime_group_is_validated_and_reaches_the_cluster():
    scenario = to_scenario(compose([]))
    assert scenario.cluster.runtime.name == "megatron_core" and 0 < scenario.cluster.runtime.gemm_scale("hopper") < 1
    with pytest.raises(ConfigError, match="runtime.gemm_efficiency_scale=0.0 must be > 0"):
        to_scenario(compose(["runtime.gemm_efficiency_scale=0"]))
    with pytest.raises(ConfigError, match="runtime.step_overhead_ms=-1"):
        to_scenario(compose(["runtime.step_overhead_ms=-1"]))
    with pytest.raises(ConfigError, match="scale_up_gpus=6 must be a multiple of gpus_per_node=4"):
        to_scenario(compose(["cluster=gb200_nvl72", "cluster.scale_up_gpus=6"]))
    gb200 = to_scenario(compose(["cluster=gb200_nvl72"])).cluster
    assert gb200.domain_gpus == 72 and gb200.gpus_per_node == 4


def test_memory_settings_reach_the_records_and_megatrons_refusals_are_named():
    scenario = to_scenario(compose(["parallel.use_megatron_fsdp=true",
                                    "parallel.data_parallel_sharding_strategy=optim_grads",
                                    "train.use_precision_aware_optimizer=true", "train.exp_avg_dtype=bf16",
                                    "train.optimizer_cpu_offload=true", "train.optimizer_offload_fraction=0.5"]))
    assert scenario.parallel.use_megatron_fsdp and scenario.parallel.data_parallel_sharding_strategy == "optim_grads"
    train = scenario.train
    assert (train.use_precision_aware_optimizer, train.exp_avg_dtype, train.exp_avg_sq_dtype) == (True, "bf16", "fp32")
    assert train.optimizer_offload_fraction == 0.5
    with pytest.raises(ConfigError, match="use_precision_aware_optimizer"):
        to_scenario(compose(["train.exp_avg_dtype=bf16"]))
    with pytest.raises(ConfigError, match="optimizer_offload_fraction"):
        to_scenario(compose(["train.use_precision_aware_optimizer=true", "train.optimizer_cpu_offload=true",
                             "train.optimizer_offload_fraction=1.5"]))
    with pytest.raises(ConfigError, match="use_distributed_optimizer"):
        to_scenario(compose(["parallel.use_megatron_fsdp=true", "parallel.use_distributed_optimizer=false"]))


_COMPOSITIONS = [
    [], ["hydra.job.name=plan"], ["output.dir=/tmp/x y", "hydra.job.name=plan"],
    ["model=llama3_8b", "train.global_batch_size=512"],
    ["cluster.num_nodes=4", "model=deepseek_v3", "parallel.tensor_model_parallel_size=2"],
    ["train.seq_length=null"], ["output.dir='/a b'"], ["model.name=${model.num_layers}"], ["profile=/x.json"],
    ["jobs=fleet_50", "cluster.num_nodes=512"], ["+experiment=writeup_70b", "search.top_k=3"],
    ["search.what_if_schedules=true", "model=gpt_48l_128k"],
]


@pytest.mark.parametrize("overrides", _COMPOSITIONS, ids=lambda o: " ".join(o) or "defaults")
@pytest.mark.parametrize("keep_hydra", [True, False])
def test_a_kept_composition_is_the_fresh_one(overrides, keep_hydra, tmp_path, monkeypatch):
    """The cache's config (its defaults' composition kept, the values applied by Hydra's code) equals Hydra's
    fresh composition, in another working directory too, and it is taken from the cache, not composed again."""
    from omegaconf import OmegaConf

    from megapipe.config import cache

    monkeypatch.setenv(cache.CACHE_DIR_ENV, "off")
    fresh = compose(overrides, return_hydra_config=keep_hydra)
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    composed = []
    real = cache._finish

    def finish(*args):
        result = real(*args)
        composed.append(result)  # applied without falling back to a fresh composition
        return result

    monkeypatch.setattr(cache, "_finish", finish)
    compose(overrides, return_hydra_config=keep_hydra)  # kept
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    if keep_hydra:
        fresh.hydra.runtime.cwd = os.getcwd()
    kept = compose(overrides, return_hydra_config=keep_hydra)
    assert len(composed) == 2 and len(os.listdir(tmp_path / "cache")) == 1
    assert OmegaConf.to_yaml(kept) == OmegaConf.to_yaml(fresh)
    assert OmegaConf.is_struct(kept) and OmegaConf.get_type(kept.train) is OmegaConf.get_type(fresh.train)


@pytest.mark.parametrize("overrides", [["train.global_batch_size=abc"], ["train.nonexistent=1"], ["model=nope"],
                                       ["train.global_batch_size=1,2"], ["model=llama3_8b", "~train.seq_length"]])
def test_a_kept_composition_refuses_what_hydra_refuses(overrides, tmp_path, monkeypatch):
    from megapipe.config import cache

    errors = []
    for where in ("off", str(tmp_path / "cache"), str(tmp_path / "cache")):
        monkeypatch.setenv(cache.CACHE_DIR_ENV, where)
        with pytest.raises(Exception) as caught:
            compose(overrides)
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1] == errors[2]


def test_a_broken_cache_entry_is_composed_again(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from megapipe.config import cache

    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    first = OmegaConf.to_yaml(compose(["model=llama3_8b"]))
    (entry,) = tmp_path.iterdir()
    entry.write_bytes(b"not a pickle")
    assert OmegaConf.to_yaml(compose(["model=llama3_8b"])) == first
    assert entry.read_bytes() != b"not a pickle"
