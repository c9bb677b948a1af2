"""The ``specrl`` command. Each subcommand lives in its own module and is imported
only when called, so ``specrl simulate`` does not pay for importing the RL stack."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with a ``main(argv) -> int``, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("specrl_jax.demo", "short GRPO run with speculative rollouts on the default task"),
    "train": ("specrl_jax.rl.app.train_command",
              "GRPO training: warm start, sync/async RL, metrics, checkpoints, plots, "
              "one or many processes"),
    "eval": ("specrl_jax.rl.app.eval_command",
             "pass@1..k and mean reward of a run's policy (or a HF model) on held-out prompts"),
    "simulate": ("specrl_jax.sim.command",
                 "roofline simulation of an RL step, plain vs speculative rollouts"),
}


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help"):
    print("usage: specrl <command> [options]\n\ncommands:")
    for name, (_, help_text) in SUBCOMMANDS.items():
      print(f"  {name:<10} {help_text}")
    return 0
  name, rest = argv[0], argv[1:]
  if name not in SUBCOMMANDS:
    print(f"specrl: unknown command {name!r}; expected one of {sorted(SUBCOMMANDS)}",
          file=sys.stderr)
    return 2
  module = importlib.import_module(SUBCOMMANDS[name][0])
  return int(module.main(rest) or 0)


if __name__ == "__main__":
  sys.exit(main())
