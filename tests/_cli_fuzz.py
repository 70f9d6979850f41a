"""Random bad input for every verb, and the check that each run ends cleanly (exit 0, or one line and exit 2).

Used by ``scripts/fuzz_cli.py`` (1,000+ cases) and by tests/test_cli_fuzz.py (a sample in CI).
A case is a verb and a list of overrides: a known key with a wrong value (zero, negative, not finite,
huge, of the wrong type), an unknown key, or a Megatron-LM flag or
stray positional word. Each case runs ``megapipe.cli.main`` in-process with
stdout and stderr captured and an alarm as a time limit.
"""

from __future__ import annotations

import contextlib
import io
import random
import signal
import traceback
from dataclasses import dataclass

__all__ = ["Case", "Outcome", "random_cases", "run_case"]

_KEYS = {
    "model": ("model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.num_query_groups",
              "model.ffn_hidden_size", "model.vocab_size", "model.seq_length", "model.kv_channels",
              "model.mtp_num_layers", "model.rotary_base"),
    "cluster": ("cluster.num_nodes", "cluster.gpus_per_node", "cluster.price_per_gpu_hour", "cluster.gpu.memory_gib",
                "cluster.gpu.bf16_tflops", "cluster.gpu.hbm_gbytes_per_s", "cluster.gpu.usable_memory_fraction",
                "cluster.gpu.matmul_efficiency", "cluster.gpu.kernel_overhead_us", "cluster.gpu.bandwidth_efficiency",
                "cluster.intra_node.bandwidth_gbytes_per_s", "cluster.inter_node.latency_us"),
    "parallel": ("parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
                 "parallel.virtual_pipeline_model_parallel_size", "parallel.context_parallel_size",
                 "parallel.microbatch_group_size_per_vp_stage"),
    "train": ("train.global_batch_size", "train.micro_batch_size", "train.seq_length", "train.num_microbatches",
              "train.total_tokens"),
    "search": ("search.top_k", "search.max_pipeline_model_parallel_size", "search.min_gain", "search.drift_threshold"),
}
_VALUES = ("0", "-1", "-7", "inf", "-inf", "nan", "1e30", "999999999", "3", "0.5", "1.5", "abc", "''", "null",
           "[1,2]", "true", "17")
_UNKNOWN = ("+train.seq_lenght=32768", "+search.foo=1", "+parallel.tensor_parallel=2", "+model.num_layer=3",
            "+cluster.gpu.memory=80", "+output.colour=1", "+frobnicate=1")
_CHOICES = ("model=llama9", "cluster=nope", "schedule=zb_x", "train.recompute_granularity=sometimes",
            "train.precision=fp13", "search.objective=speed", "output.format=xml", "search.bubble_target=[0.9,0.1]",
            "search.bubble_target=[2,3]", "search.bubble_target=[0.99,1.0]", "search.bubble_warning_range=[1]",
            "search.replan_attribution=guess", "stage_times=[[1,2]]", "stage_times=[[1,-1,1]]", "profile=/no/such.yaml",
            "model=hf", "extra.iters=-1")
_STRAY = (("--tensor-model-parallel-size", "2"), ("--num-layers", "40"), ("--foo",), ("--use-distributed-optimizer",),
          ("2:40",), ("llama3_70b",), ("tensor_model_parallel_size=2",), ("train.seq_lenght=8192",),
          ("num_layers=3",), ("--micro-batch-size=2",))
"""Megatron-LM style flags, positional words, keys without their group or with a typo, all refused."""
VERBS = ("plan", "partition", "simulate", "report", "calibrate", "replan", "profile")
_SMALL = ("model=tiny_gpt", "cluster=cpu_gloo", "train.global_batch_size=8")
"""What each case starts from, so that a valid case plans in well under a second."""


@dataclass(frozen=True, slots=True)
class Case:
    verb: str
    overrides: tuple[str, ...]

    def argv(self) -> list[str]:
        return [self.verb, *self.overrides]


@dataclass(frozen=True, slots=True)
class Outcome:
    case: Case
    code: int | None
    """Exit code; None when the case raised or timed out."""
    stderr: str
    problem: str = ""
    """Empty when the run ended cleanly; else what was wrong (traceback, hang, several error lines)."""


def random_cases(count: int, *, seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        verb = rng.choice(VERBS)
        bad = []
        for _ in range(rng.choice((1, 1, 2, 3))):
            kind = rng.random()
            if kind < 0.6:
                group = rng.choice(tuple(_KEYS))
                bad.append(f"{rng.choice(_KEYS[group])}={rng.choice(_VALUES)}")
            elif kind < 0.7:
                bad.append(rng.choice(_UNKNOWN))
            elif kind < 0.8 and verb not in ("report", "replan", "calibrate") or kind < 0.75:
                bad.extend(rng.choice(_STRAY))
            else:
                bad.append(rng.choice(_CHOICES))
        path = ("/no/such/dir",) if verb in ("report", "replan", "calibrate") and rng.random() < 0.5 else ()
        cases.append(Case(verb=verb, overrides=(*path, *_SMALL, *bad)))
    return cases


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run_case(case: Case, *, directory: str, limit_s: int = 30) -> Outcome:
    """Run one case in-process; a clean run exits 0, or exits 2 with exactly one stderr line."""
    from megapipe.cli import main

    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit_s)
    code, problem = None, ""
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([*case.argv(), f"output.dir={directory}", "output.pictures=false"])
    except _Timeout:
        problem = f"hang: still running after {limit_s} s"
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException:  # a traceback is exactly what this looks for
        problem = "traceback: " + traceback.format_exc().strip().splitlines()[-1]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    lines = [line for line in err.getvalue().splitlines() if line.strip() and not line.startswith("warning:")]
    if not problem and code not in (0, 2):
        problem = f"exit code {code}"
    if not problem and code == 2 and len(lines) != 1:
        problem = f"{len(lines)} error lines"
    if not problem and "Traceback" in err.getvalue():
        problem = "traceback on stderr"
    return Outcome(case=case, code=code, stderr=err.getvalue(), problem=problem)
