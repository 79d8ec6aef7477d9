"""Spatial VQA comparison table (GOAT paper, Tables 9-10): fit + test several configs, print Markdown.

Usage (one command; extra arguments after ``--`` are LightningCLI overrides applied to every config)::

    python scripts/vqa_table.py configs/vqa/{nope,rope,goat}_cifar10.yaml -- --data.init_args.root /path/to/cifar
    python scripts/vqa_table.py configs/vqa/{nope,rope,goat}_digits.yaml            # CPU, embedded digits

Each config is trained with its own trainer settings (runs under ``runs/<task>/<run_name>``), then
tested with the final weights. Columns: answer NLL (nats) and exact answer accuracy on seen and on
held-out scan orders, and the held-out minus seen accuracy gap.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from mixlab.cli import MixlabCLI

    if "--" in argv:
        split = argv.index("--")
        configs, overrides = argv[:split], argv[split + 1:]
    else:
        configs, overrides = argv, []
    if not configs:
        raise SystemExit(__doc__)
    rows = []
    for cfg in configs:
        cli = MixlabCLI(args=["--config", cfg, *overrides], run=False)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        res = cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)[0]
        rows.append((cli.model.run_name, res))
    print("\n| model | NLL seen | NLL held-out | acc seen | acc held-out | held-out - seen |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['test/loss_seen']:.3f} | {r['test/loss_heldout']:.3f} | {100 * r['test/acc_seen']:.1f}% "
              f"| {100 * r['test/acc_heldout']:.1f}% | {100 * (r['test/acc_heldout'] - r['test/acc_seen']):+.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
