"""A runnable Megatron-LM launch for one plan: the environment, ``torchrun`` and the arguments.

The script runs ``pretrain_gpt.py`` from ``$MEGATRON_LM`` on every node with the node's rank
(``NODE_RANK``) and the rendezvous address (``MASTER_ADDR``, ``MASTER_PORT``) the launcher gives;
what the plan cannot know (data, tokenizer, iterations and learning-rate schedule) is passed through
as its arguments. On a mixed cluster the header lists which GPU type each node rank must have.
"""

from __future__ import annotations

from collections.abc import Sequence

from megapipe.emit.emitted import Emitted
from megapipe.emit.quoting import shell_quote

__all__ = ["launch_script", "launch_line", "node_rank_lines"]


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


def node_rank_lines(names: Sequence[str]) -> str:
    """``<node rank> <gpu type>`` per line: what a launcher's host list must follow on a mixed cluster."""
    return "".join(f"{rank} {name}\n" for rank, name in enumerate(names))
