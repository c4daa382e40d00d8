"""Draw bench/growth.png from the JSON that bench/scale.py writes (run with the kernel-venv's python,
which has matplotlib): python plot_growth.py DATA.json OUT.png"""

import json
import sys

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, out: str) -> None:
    d = json.loads(open(src).read())
    for key, vals in d.items():
        if isinstance(vals, list):
            d[key] = [float("nan") if v is None else v for v in vals]
    x = d["live"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(x, d["exec_median"], "o-", label="execute 1+1, median")
    left.plot(x, d["exec_p95"], "s--", label="execute 1+1, p95")
    left.set_title("warm execute round trip (REST)")
    left.set_ylim(bottom=0)
    right.plot(x, d["create_pool_median"], "o-", color="tab:green", label="create from pool + first execute, median")
    right.plot(x, d["create_cold_median"], "s-", color="tab:red", label="cold create + first execute, median")
    right.set_title("session create until the first execute ran")
    right.set_yscale("log")
    right.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    right.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax in (left, right):
        ax.set_xlabel("live idle sessions")
        ax.set_ylabel("ms")
        ax.set_xticks(x)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(d.get("title", ""))
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
