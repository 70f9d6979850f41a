"""A runnable Megatron-LM launch for one plan: the environment, ``torchrun`` and the arguments.

The script runs ``pretrain_gpt.py`` from ``$MEGATRON_LM`` on every node with the node's rank
(``NODE_RANK``) and the rendezvous address (``MASTER_ADDR``, ``MASTER_PORT``) the launcher gives;
what the plan cannot know (data, tokenizer, iterations and learning-rate schedule) is passed through
as its arguments. On a mixed cluster the header lists which GPU type each node rank must have.

:func:`slurm_script` is the same launch as a Slurm batch script: ``#SBATCH`` asks for the plan's nodes
and GPUs, the first host of the allocation is the rendezvous, and ``srun`` starts one ``torchrun`` per
node with ``SLURM_NODEID`` as its node rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from megapipe.emit.emitted import Emitted
from megapipe.emit.quoting import shell_quote

__all__ = ["launch_script", "launch_line", "node_rank_lines", "slurm_script"]


def launch_line(emitted: Emitted, *, gpus_per_node: int, num_nodes: int) -> str:
    """One shell line: environment, torchrun over the plan's nodes, pretrain_gpt.py and the plan's arguments."""
    env = f"{emitted.env_prefix} " if emitted.env_prefix else ""
    return (f"{env}torchrun --nproc-per-node {gpus_per_node} --nnodes {num_nodes} --node-rank $NODE_RANK "
            f"--master-addr $MASTER_ADDR --master-port ${{MASTER_PORT:-6000}} $MEGATRON_LM/pretrain_gpt.py "
            f"{emitted.megatron_command}")


def launch_script(emitted: Emitted, *, gpus_per_node: int, num_nodes: int, vocab_size: int,
                  node_ranges: str = "", title: str = "") -> str:
    """The bash script of :func:`launch_line`, with the tokens one per line and the user's arguments appended."""
    lines = ["#!/usr/bin/env bash", f"# {title or 'megapipe plan'}: Megatron-LM launch for one node.",
             "# Run on every node: NODE_RANK=<0..N-1> MASTER_ADDR=<node 0> MEGATRON_LM=<checkout> "
             "bash launch_megatron.sh <your flags>",
             "# Add the data, tokenizer and schedule flags, e.g. --data-path ... (or --mock-data) "
             f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model ... (a {vocab_size:,}-token vocabulary, as "
             "planned) --train-iters ... --eval-interval ... --lr ... --lr-decay-style cosine"]
    if node_ranges:
        lines.append(f"# Node ranks and the GPU type each must have: {node_ranges}")
    lines.append("set -euo pipefail")
    lines += [f"export {name}={shell_quote(value)}" for name, value in emitted.megatron_env]
    lines.append("MEGATRON_ARGS=(")
    lines += [f"  {shell_quote(token)}" for token in emitted.megatron_args]
    lines.append(")")
    lines.append(f"exec torchrun --nproc-per-node {gpus_per_node} --nnodes {num_nodes} --node-rank \"$NODE_RANK\" "
                 "--master-addr \"$MASTER_ADDR\" --master-port \"${MASTER_PORT:-6000}\" "
                 "\"$MEGATRON_LM/pretrain_gpt.py\" \"${MEGATRON_ARGS[@]}\" \"$@\"")
    return "\n".join(lines) + "\n"


def slurm_script(emitted: Emitted, *, gpus_per_node: int, num_nodes: int, vocab_size: int, job_name: str,
                 node_ranges: str = "", title: str = "") -> str:
    """``sbatch launch_slurm.sbatch <your flags>``: the launch of :func:`launch_script` on a Slurm allocation."""
    lines = ["#!/usr/bin/env bash", f"#SBATCH --job-name={_job_name(job_name)}", f"#SBATCH --nodes={num_nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={gpus_per_node}", "#SBATCH --exclusive",
             f"# {title or 'megapipe plan'}: Megatron-LM through Slurm.",
             "# MEGATRON_LM=<checkout> sbatch launch_slurm.sbatch <your flags> (sbatch passes the environment on)",
             "# Add the data, tokenizer and schedule flags, e.g. --data-path ... (or --mock-data) "
             f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model ... (a {vocab_size:,}-token vocabulary, as "
             "planned) --train-iters ... --lr ...; add your site's #SBATCH --partition/--account/--time"]
    if node_ranges:
        lines.append(f"# Node ranks (SLURM_NODEID, in the allocation's host order) and the GPU type each must have: "
                     f"{node_ranges}; pin the order with #SBATCH --nodelist")
    lines += ["set -euo pipefail", ': "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout}"',
              'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',  # sed reads all: no SIGPIPE
              'export MASTER_ADDR MASTER_PORT="${MASTER_PORT:-6000}"']
    lines += [f"export {name}={shell_quote(value)}" for name, value in emitted.megatron_env]
    lines.append("MEGATRON_ARGS=(")
    lines += [f"  {shell_quote(token)}" for token in emitted.megatron_args]
    lines.append(")")
    lines.append(f"srun --kill-on-bad-exit=1 bash -c 'exec torchrun --nproc-per-node {gpus_per_node} --nnodes "
                 f"{num_nodes} --node-rank \"$SLURM_NODEID\" --master-addr \"$MASTER_ADDR\" --master-port "
                 "\"$MASTER_PORT\" \"$MEGATRON_LM/pretrain_gpt.py\" \"$@\"' torchrun \"${MEGATRON_ARGS[@]}\" \"$@\"")
    return "\n".join(lines) + "\n"


def _job_name(name: str) -> str:
    """A Slurm job name: the plan's name with anything but letters, digits, '-', '_' and '.' replaced."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name) or "megapipe"


def node_rank_lines(names: Sequence[str]) -> str:
    """``<node rank> <gpu type>`` per line: what a launcher's host list must follow on a mixed cluster."""
    return "".join(f"{rank} {name}\n" for rank, name in enumerate(names))
