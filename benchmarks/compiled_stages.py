"""Where a compiled program would save time in the recommendation forward: the published TorchScript
program vs the same model's stages after the user tower (retrieve -> rank -> best) compiled by
TorchInductor into C++ (`cpp_wrapper`: the code AOTInductor would package), batch 1 and 16.

    .venv/bin/python benchmarks/compiled_stages.py --checkpoint out/demo/model.ckpt   # ~2 min

The model is composed from the checkpoint as `silverrec publish` composes it (MoL OverArch, the
recommend benchmark's value model, K0 200, K1 256). Requests are real MovieLens users' training
histories, unfiltered. Sides, one thread, alternated call by call (benchmarks/common.py's
`alternate`): `torchscript` = the whole forward as a snapshot runs it (`publish.rec.scriptable`);
`eager_tail` = the stages after the user tower, eager; `inductor_tail` = the same stages compiled
(the user tower is left out: torchrec's int8 table-batched embedding keeps a TensorQueue that
torch.compile cannot trace). `user_tower` = the eager user tower alone, for the arithmetic
"compiled tail + tower" against the TorchScript forward. Outputs of the compiled tail are checked
against the eager tail (same item rows). Writes benchmarks/results/compiled_stages.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Panel, alternate, plot_only, print_table, replot, save_plot, write_results  # noqa: E402

from silverrec.filtering.filter_program import FilterPlan, compile_request  # noqa: E402
from silverrec.publish.rec import PublishConfig, build_rec_model  # noqa: E402
from silverrec.publish.rec_files import scriptable  # noqa: E402
from silverrec.publish.train import load_checkpoint  # noqa: E402
from silverrec.retrieval.user_tower import FeatureEncoder, UserFeatureSpec  # noqa: E402

VALUE_MODEL = {"weights": {"interacted": 1.0, "liked": 0.5}}
K, K0, CANDIDATES, NPROBE, MAX_PROBE = 10, 200, 256, 49, 200


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a `silverrec train` checkpoint with a 'mol' OverArch")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args(argv)
    import torch._inductor.config as inductor_config

    torch.set_num_threads(1)
    ckpt = load_checkpoint(args.checkpoint)
    built = build_rec_model(PublishConfig(checkpoint=args.checkpoint, overarch="mol", value_model=VALUE_MODEL, k0=K0,
                                          candidates=CANDIDATES), ckpt)
    model = built.model.eval()
    ts = scriptable(model)
    spec = UserFeatureSpec.from_json(ckpt["spec"])
    encoder = FeatureEncoder.from_arrays(spec, built.item_csr)
    off, hist = ckpt["users"]["offsets"], ckpt["users"]["item_ids"]
    order = np.argsort(built.row_to_item)  # item id -> canonical row
    rows_of = lambda ids: order[np.searchsorted(built.row_to_item[order], ids)]  # noqa: E731
    histories = [rows_of(np.asarray(hist[off[u]:off[u + 1]])) for u in range(len(off) - 1) if off[u + 1] > off[u]]
    inductor_config.cpp_wrapper = True
    nprobe, max_probe = min(NPROBE, built.spec.nlist), min(MAX_PROBE, built.spec.nlist)

    def head(values, lengths, dense, ops, rows, vops, vrows, lists):
        """The user tower and the filter template (RecModel.forward's first two stages)."""
        return model.user_tower(values, lengths, dense), *model.filter_template(values, lengths, ops, rows, vops, vrows, lists)

    def tail(user, exclude, ops, rows, vops, vrows, lists, mode, history, flags):
        """RecModel.forward's stages after them: sources, OverArch, value model, top k."""
        cand = model.sources(user, exclude, ops, rows, vops, vrows, lists, mode, history, flags, K, K0, nprobe, max_probe)
        task_scores = model.overarch(user, cand)
        return model.top_k(user, cand, model.value_model(task_scores, cand), task_scores, K)

    compiled = torch.compile(tail, dynamic=False)
    out = []
    for batch in (1, 16):
        hs = histories[:batch]
        values, lengths, dense = encoder.encode(hs)
        exclude = torch.from_numpy(np.stack([np.sort(np.pad(h, (64, 0), constant_values=-1)[-64:]) for h in hs]))  # newest 64, -1 first
        ops, rows, vops, vrows, lists = compile_request([None] * batch, FilterPlan.from_config(built.manifest["filter"]))
        mode = torch.zeros(batch, dtype=torch.int64)
        history, flags = torch.full((batch, 1), -1, dtype=torch.int64), torch.ones(batch, 2, dtype=torch.bool)
        full = (values, lengths, dense, exclude, ops, rows, vops, vrows, lists, mode, history, flags, K, K0, nprobe,
                max_probe)
        with torch.inference_mode():
            user, *progs = head(values, lengths, dense, ops, rows, vops, vrows, lists)
            targs = (user, exclude, *progs, mode, history, flags)
            t0 = time.perf_counter()
            got = compiled(*targs)
            compile_s = time.perf_counter() - t0
            want = tail(*targs)
            same = bool(torch.equal(got[3], want[3]))
            timed = alternate([lambda: ts(*full), lambda: tail(*targs), lambda: compiled(*targs),
                               lambda: head(values, lengths, dense, ops, rows, vops, vrows, lists)],
                              args.repeat, warmup=5)
        names = ("torchscript", "eager_tail", "inductor_tail", "user_tower")
        row = {"batch": batch, "compile_seconds": round(compile_s, 1), "inductor_tail_rows_equal_eager": same,
               **{f"{n}_us": round(t["median_ms"] * 1e3, 1) for n, t in zip(names, timed)}}
        row["inductor_tail_plus_tower_over_torchscript"] = round(
            (row["inductor_tail_us"] + row["user_tower_us"]) / row["torchscript_us"], 3)
        out.append(row)
        print(row, flush=True)
    print_table(out, list(out[0]))
    replot(write_results("compiled_stages", {"checkpoint": args.checkpoint, "threads": 1, "k": K, "k0": K0,
                                             "candidates": CANDIDATES, "nprobe": nprobe}, out).stem, plot)
    return 0


def plot(payload: dict, path: Path) -> None:
    """Per batch: the TorchScript forward against the compiled stages after the user tower plus the tower."""
    rows = payload["rows"]
    batches = [f"batch {r['batch']}" for r in rows]
    series = {"TorchScript forward (published)": (batches, [r["torchscript_us"] / 1e3 for r in rows]),
              "eager tail + user tower": (batches, [(r["eager_tail_us"] + r["user_tower_us"]) / 1e3 for r in rows]),
              "Inductor-compiled tail + user tower": (batches, [(r["inductor_tail_us"] + r["user_tower_us"]) / 1e3 for r in rows])}
    save_plot(path, [Panel("one recommendation forward, MovieLens model", "batch", "ms per call (median)", series,
                           kind="bar", logy=True)], "would compiling the forward pay? (1 thread)")


if __name__ == "__main__" and not plot_only(plot, "compiled_stages"):
    sys.exit(main())
