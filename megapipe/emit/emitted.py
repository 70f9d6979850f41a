"""One partition and its parallel/train settings, written for every Megatron front end.

:func:`emit` refuses a what-if plan (a pipelined schedule megatron-core does not run): its
arguments would describe a pipeline other than the one simulated.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.emit.megatron import megatron_args, megatron_env
from megapipe.emit.memory import memory_warnings
from megapipe.emit.overrides import BridgeKeys, bridge_settings, nemo1_settings, nemo2_settings, to_overrides
from megapipe.emit.precision import bridge_precision, nemo1_precision, tp_overlap_on
from megapipe.emit.quoting import cli_number, shell_join, shell_quote
from megapipe.emit.stages import StageKinds, decoder_counts, equal_stage_kinds, is_equal_split, validate_stages
from megapipe.errors import ConfigError
from megapipe.layout import format_layout, parse_layout
from megapipe.records import Activation, GpuSpec, LayerKind, ModelSpec, ParallelSpec, Partition, TrainSpec
from megapipe.schedules import megatron_warnings

__all__ = ["Emitted", "emit"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Emitted:
    """What to paste into a Megatron-LM, Megatron-Bridge, NeMo 2 or NeMo 1 launch."""

    layout: str
    """Megatron ``pipeline_model_parallel_layout``, vp-major stages."""
    megatron_args: tuple[str, ...]
    """argv tokens for Megatron-LM's ``pretrain_gpt.py``: parallelism, model shape, precision, overlap."""
    megatron_env: tuple[tuple[str, str], ...]
    """Environment variables Megatron-LM's start-up checks need (CUDA_DEVICE_MAX_CONNECTIONS)."""
    bridge_overrides: tuple[str, ...]
    bridge_keys: BridgeKeys
    """Which Megatron-Bridge spelling the overrides use (flat ``model.*`` for 0.6.x, nested for main)."""
    nemo2_overrides: tuple[str, ...]
    nemo1_overrides: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    """Settings that could not be expressed as planned."""
    nemo1_unrunnable: tuple[str, ...] = ()
    """Why NeMo 1 cannot run the plan as planned (also among the warnings): it rejects the layer split, or it
    cannot set the plan's FP8 recipe. The plan dir's nemo1_overrides.txt says so on its first line."""

    @property
    def megatron_command(self) -> str:
        """The Megatron-LM arguments as one shell-quoted line."""
        return shell_join(self.megatron_args)

    @property
    def env_prefix(self) -> str:
        """``NAME=value`` words to put before the launcher, or empty."""
        return " ".join(f"{name}={shell_quote(value)}" for name, value in self.megatron_env)

    @property
    def bridge_command(self) -> str:
        """The Megatron-Bridge overrides as one shell line."""
        return shell_join(self.bridge_overrides)

    @property
    def nemo2_command(self) -> str:
        """The NeMo 2 overrides as one shell line."""
        return shell_join(self.nemo2_overrides)

    @property
    def nemo1_command(self) -> str:
        """The NeMo 1 overrides as one shell line."""
        return shell_join(self.nemo1_overrides)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: lists of tokens plus the shell lines."""
        return {
            "layout": self.layout,
            "megatron_args": list(self.megatron_args),
            "megatron_command": self.megatron_command,
            "megatron_env": dict(self.megatron_env),
            "bridge_overrides": list(self.bridge_overrides),
            "bridge_command": self.bridge_command,
            "bridge_keys": self.bridge_keys.value,
            "nemo2_overrides": list(self.nemo2_overrides),
            "nemo2_command": self.nemo2_command,
            "nemo1_overrides": list(self.nemo1_overrides),
            "nemo1_command": self.nemo1_command,
            "warnings": list(self.warnings),
        }


def _check_sizes(partition: Partition, parallel: ParallelSpec) -> None:
    planned = (partition.pipeline_model_parallel_size, partition.virtual_pipeline_model_parallel_size)
    given = (parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size)
    if planned != given:
        raise ConfigError(
            f"partition was planned for (pipeline, virtual) sizes {planned} but parallel has {given}; "
            "re-partition with the same parallel settings"
        )
    if parallel.virtual_pipeline_model_parallel_size > 1 and parallel.pipeline_model_parallel_size == 1:
        raise ConfigError(
            f"virtual_pipeline_model_parallel_size={parallel.virtual_pipeline_model_parallel_size} needs "
            "pipeline_model_parallel_size > 1 (Megatron-LM asserts it); set virtual_pipeline_model_parallel_size=1"
        )
    if partition.layout and parse_layout(partition.layout) != tuple(tuple(k) for k in partition.stage_kinds):
        raise ConfigError(
            f"partition layout {partition.layout!r} disagrees with its stage_kinds "
            f"{format_layout(partition.stage_kinds)!r}; rebuild the partition"
        )


def _check_model(partition: Partition, model: ModelSpec) -> None:
    flat = [kind for kinds in partition.stage_kinds for kind in kinds]
    counts = (flat.count(LayerKind.decoder), flat.count(LayerKind.mtp))
    if counts != (model.num_layers, model.mtp_num_layers):
        raise ConfigError(
            f"partition holds {counts[0]} decoder and {counts[1]} MTP layers but model {model.name!r} has "
            f"num_layers={model.num_layers}, mtp_num_layers={model.mtp_num_layers}; partition this model")


def _nemo1_warnings(stage_kinds: StageKinds, parallel: ParallelSpec) -> list[str]:
    sizes = {
        "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": parallel.virtual_pipeline_model_parallel_size,
    }
    flat = [kind for kinds in stage_kinds for kind in kinds]
    warnings = []
    if LayerKind.mtp in flat:
        warnings.append("NeMo 1 has no multi-token-prediction layers; the m entries of the layout are dropped")
    if is_equal_split(stage_kinds, **sizes):
        return warnings
    num_layers = flat.count(LayerKind.decoder)
    num_chunks = parallel.pipeline_model_parallel_size * parallel.virtual_pipeline_model_parallel_size
    counts = "/".join(map(str, decoder_counts(stage_kinds)))
    if equal_stage_kinds(num_layers=num_layers, **sizes) is None:
        fallback = f"{num_layers=} does not divide over {num_chunks} model chunks, so NeMo 1 will reject it"
    else:
        fallback = f"Megatron will split equally, {num_layers // num_chunks} decoder layers per model chunk"
    warnings.append(
        f"NeMo 1 has no per-stage key: the uneven layout ({counts} decoder layers) cannot be expressed; {fallback}"
    )
    return warnings


def _nemo1_unrunnable(stage_kinds: StageKinds, parallel: ParallelSpec, train: TrainSpec) -> tuple[str, ...]:
    """What stops NeMo 1 running the plan as planned: a layer count that does not divide over the model chunks
    (it has no layout key, and Megatron's equal split needs one), or an FP8 recipe other than delayed scaling."""
    reasons = list(nemo1_precision(train, parallel)[1])
    num_layers = sum(kind == LayerKind.decoder for kinds in stage_kinds for kind in kinds)
    pp, vp = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
    if equal_stage_kinds(num_layers=num_layers, pipeline_model_parallel_size=pp,
                         virtual_pipeline_model_parallel_size=vp) is None:
        reasons.append(f"{num_layers=} does not divide over {pp * vp} model chunks (no layout key), so NeMo 1 "
                       "rejects these overrides")
    return tuple(reasons)


def _delay_wgrad_requirement(model: ModelSpec, parallel: ParallelSpec) -> str:
    """The Transformer Engine delay_wgrad_compute needs, as Megatron-LM checks it at start-up (validate_args,
    TransformerConfig): 2.8 with --overlap-grad-reduce; 2.10 with TE CUDA graphs; at megatron-core 0.19 and later
    2.12 when a graph holds weight gradients (attn, or moe_router with shared experts not overlapped)."""
    features = parallel.features
    scopes = set(features.cuda_graph_scope)
    if features.cuda_graph_impl != "transformer_engine":
        return "delay_wgrad_compute needs Transformer Engine >= 2.8 with --overlap-grad-reduce (Megatron-LM checks it)"
    wgrad_in_graph = "attn" in scopes or ("moe_router" in scopes and bool(model.moe_shared_expert_intermediate_size)
                                          and not features.moe_shared_expert_overlap)
    if wgrad_in_graph:
        return ("delay_wgrad_compute with Transformer Engine CUDA graphs of "
                f"{'/'.join(features.cuda_graph_scope)} needs Transformer Engine >= 2.12 at megatron-core 0.19 and "
                "later (2.10 at 0.16) and gradient accumulation fusion (Megatron's default); Megatron-LM checks it")
    return ("delay_wgrad_compute with Transformer Engine CUDA graphs needs Transformer Engine >= 2.10 "
            "(Megatron-LM checks it)")


def _feature_warnings(model: ModelSpec, parallel: ParallelSpec) -> list[str]:
    """What the runtime features need beyond the arguments, and where a front end cannot carry them."""
    features, warnings = parallel.features, []
    if model.is_moe and features.moe_token_dispatcher_type == "flex":
        warnings.append(f"the flex dispatcher with {features.moe_flex_dispatcher_backend} needs the deep_ep package "
                        f"({'DeepEP' if features.moe_flex_dispatcher_backend == 'deepep' else 'its hybrid-ep build'}; "
                        "NVIDIA's Megatron-Bridge and NeMo containers ship it)")
    if features.delay_wgrad_compute:
        warnings.append(_delay_wgrad_requirement(model, parallel))
    defaults = type(features)()
    changed = [name for name in ("moe_token_dispatcher_type", "overlap_moe_expert_parallel_comm",
                                 "moe_shared_expert_overlap", "moe_permute_fusion", "moe_router_fusion",
                                 "cuda_graph_impl", "moe_router_force_load_balancing",
                                 "moe_router_padding_for_quantization")
               if getattr(features, name) != getattr(defaults, name) and (model.is_moe or name == "cuda_graph_impl")]
    if changed:
        warnings.append(f"NeMo 1 has no keys for the runtime features {', '.join(changed)}; its overrides leave them "
                        "at Megatron's defaults, so it would run slower than planned")
    if features.fine_grained_activation_offloading:
        warnings.append("NOT EMITTED: fine-grained activation offloading for NeMo 1, which has no key for it; the "
                        "plan's memory counts on the offload modules' inputs leaving the GPU")
    return warnings


def emit(*, partition: Partition, parallel: ParallelSpec, train: TrainSpec, model: ModelSpec,
         gpus: tuple[GpuSpec, ...], bridge_keys: BridgeKeys = BridgeKeys.flat, domain_gpus: int = 8,
         gpus_per_node: int | None = None) -> Emitted:
    """Write ``partition`` for every front end; ConfigError if Megatron could not run it as planned.

    ``gpus``: the GPU type of each pipeline rank (what the environment the launch needs depends on);
    ``domain_gpus``: the GPUs of one NVLink domain (HybridEP's topology variables); ``gpus_per_node``: the
    node size, for NeMo 2's trainer.num_nodes and trainer.devices.
    """
    _check_sizes(partition, parallel)
    _check_model(partition, model)
    validate_stages(
        partition.stage_kinds,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
    )
    what_if = megatron_warnings(partition.schedule, pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
                                virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size)
    if what_if:
        raise ConfigError(f"{what_if[0]}; plan with schedule=1f1b or interleaved_1f1b to get Megatron arguments")
    layout = format_layout(partition.stage_kinds)
    warnings = []
    if parallel.sequence_parallel and parallel.tensor_model_parallel_size == 1:
        warnings.append("sequence_parallel needs tensor_model_parallel_size > 1; it is left off, as Megatron does")
    warnings += [f"NOT EMITTED: {model.name} has {feature}, which megapipe neither costs nor writes to any argument "
                 "file; the model these arguments build lacks it (add its Megatron flags yourself)"
                 for feature in model.not_modelled]
    warnings += bridge_precision(train, parallel)[1] + nemo1_precision(train, parallel)[1]
    if model.use_rope_scaling:
        warnings.append(f"NeMo 2 sets Llama 3.1's RoPE scaling in its Llama31Config (scale_factor "
                        f"{cli_number(model.rope_scaling_factor)}), which no override sets: start from a Llama 3.1 "
                        "recipe there")
    if tp_overlap_on(parallel):
        warnings.append("NeMo 2 turns on TP communication overlap with MegatronCommOverlapCallback(tp_comm_overlap=True) "
                        "in the recipe's callbacks, which no override sets")
    if Activation(model.activation) == Activation.squared_relu:
        warnings.append("squared ReLU is a function in Megatron-Bridge and NeMo configs: start from a Nemotron "
                        "recipe there (Megatron-LM gets --squared-relu)")
    warnings += _feature_warnings(model, parallel) + memory_warnings(train, parallel)
    env = megatron_env(parallel=parallel, gpus=gpus, domain_gpus=domain_gpus)
    return Emitted(
        layout=layout,
        megatron_args=megatron_args(layout=layout, parallel=parallel, train=train, model=model),
        megatron_env=tuple(env.items()),
        bridge_overrides=to_overrides(bridge_settings(layout=layout, parallel=parallel, train=train, model=model,
                                                      env=env, keys=bridge_keys)),
        bridge_keys=BridgeKeys(bridge_keys),
        nemo2_overrides=to_overrides(nemo2_settings(layout=layout, parallel=parallel, train=train, model=model,
                                                    gpus_per_node=gpus_per_node)),
        nemo1_overrides=to_overrides(nemo1_settings(parallel=parallel, train=train, model=model)),
        warnings=tuple(warnings + _nemo1_warnings(partition.stage_kinds, parallel)),
        nemo1_unrunnable=_nemo1_unrunnable(partition.stage_kinds, parallel, train),
    )
