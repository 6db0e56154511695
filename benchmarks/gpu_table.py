"""The GPU benchmark's long table: ``benchmarks.bench_gpu``'s samples -> rows, and its console table.

Derived rows, per N (full call) and per (N, P) (emulated ranks):

  * fraction of theoretical = (t_full / P) / t_rank, paired per iteration, for t_rank = the slowest
    rank (``max_rank``) and the mean over ranks (``mean_rank``), against every full-call provider;
    the note names the one using the same kernel as the ring.
  * FLOPs (the flash-attention convention; causal counts N^2/2 score entries):
        forward  F_fwd(N) = 4 * B * Hq * D * N^2 / 2      (QK^T and PV, 2 FLOPs per multiply-add)
        backward F_bwd = 2.5 * F_fwd,  fwd+bwd = 3.5 * F_fwd
    A zigzag rank computes exactly 1/P of it (P steps of T^2/2 score entries each), so achieved
    TFLOP/s of a rank = (F / P) / t_rank.
  * peak memory (CUDA only): growth of ``torch.cuda.max_memory_allocated`` over one fwd+bwd (inputs
    excluded, gradients included), max over the P emulated ranks; ratio P * peak_rank / peak_full.
  * overlap threshold. Per ring hop (derived from ``hf_ring.ops.schedule.make_schedule``: every zigzag step
    is one kernel call over T^2/2 score entries -- step 0 a causal T x T block, the others a
    non-causal T/2 x T or T x T/2 block):
        forward : compute C_f = 4 * B * Hq * D * T^2 / 2 = 2 B Hq D T^2 FLOPs,
                  message K/V = 2 * B * T * Hkv * D * b bytes                     (b = element bytes)
        backward: compute 2.5 * C_f; messages K/V plus the float32 dK/dV accumulator,
                  2 * B * T * Hkv * D * (b + 4) bytes, on the same link direction.
    With achieved FLOP/s F and link bandwidth BW (bytes/s, per direction) a hop is hidden when
    compute >= transfer, i.e.  T >= F * b * Hkv / (BW * Hq)            (forward)
                               T >= F * (b + 4) * Hkv / (2.5 * BW * Hq) (backward),
    which is ``hf_ring.planner.plan``'s "ring overlap" condition. Measured version: the per-step compute
    time is t_step = t_rank / P (forward and backward separately; fastest rank, the one with least
    compute to hide behind) and, compute being quadratic and transfer linear in T,
        T*_fwd = T * t_xfer_fwd(T) / t_step_fwd(T),   T*_bwd = T * t_xfer_bwd(T) / t_step_bwd(T),
    threshold = max of the two (= the formula above with F the throughput measured at T = N/P).
    Also reported: ``plan()``'s threshold with its default 400 TFLOP/s (``planner_default_flops``)
    and with the rank's measured fwd+bwd throughput (``planner_measured_flops``), and whether
    T = N/P >= the measured threshold (``gpu_overlap_hidden``).
  * ``gpu_emulation_check``: relative error (Frobenius) of the emulated ranks' out and dQ, fed the right
    K/V blocks (``gpu_timing.oracle_fill``), against a float32 full-sequence reference (max over ranks).
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.harness import Table, stats

PLANNER_DEFAULT_FLOPS = 400e12  # hf_ring.planner.plan's default ``flops``


def fwd_flops(n: int, b: int, hq: int, d: int) -> float:
    """Causal forward FLOPs over n tokens: 4 * B * Hq * D * n^2 / 2."""
    return 4.0 * b * hq * d * n * n / 2


def planner_threshold(cfg: dict, n: int, p: int, bw_gbps: float, flops: float | None) -> int:
    """``hf_ring.planner.plan``'s ring-overlap threshold (tokens per rank) for this attention shape."""
    from hf_ring.planner import KNOWN_MODELS, ModelShape, PlanSettings, plan

    shape = dict(KNOWN_MODELS["Llama-3.1-8B"], num_attention_heads=cfg["Hq"], num_key_value_heads=cfg["Hkv"],
                 head_dim=cfg["D"])  # fmt: skip
    kw = {} if flops is None else {"flops": flops}
    settings = PlanSettings(seq_len=n, gpus=p, cp=p, dtype=cfg["dtype"], intra_GBps=bw_gbps, inter_GBps=bw_gbps,
                            gpus_per_node=p, **kw)  # fmt: skip
    pl = plan(ModelShape.from_config(shape, name="bench_gpu"), settings)
    return int(pl.overlap["threshold_tokens"])


def build_rows(results: dict, cfg: dict, env: dict, links: dict, meta: dict) -> list[dict]:
    """``bench_gpu.main``'s results (the check, per N the samples and peaks) -> the long table."""
    b, hq, hkv, d = cfg["B"], cfg["Hq"], cfg["Hkv"], cfg["D"]
    nbytes = torch.empty(0, dtype=env["dtype"]).element_size()
    threads = torch.get_num_threads()
    kernel = env["kernel_name"]
    same = "flash_attn_full" if kernel == "flash_attn" else "sdpa_full"

    tab = Table(meta, lambda p: threads)
    add = tab.add

    def one(x):
        return (x, x, x)

    shape = f"B={b}, Hq={hq}, Hkv={hkv}, D={d}, {cfg['dtype']}, causal"
    if "check" in results:
        n, p, err = results["check"]
        for key in ("out", "dq"):
            add("gpu_emulation_check", "hf_ring_emulated", f"rel_err.{key}", p, n, one(err[key]), "rel_err",
                note=f"max over the {p} emulated ranks, exact K/V delivered (oracle_fill), vs float32 full "
                     f"attention; kernel {kernel}; {shape}")  # fmt: skip
    for n, res in results["per_n"].items():
        if "skipped" in res:
            for p in cfg["Ps"]:
                add("gpu_skipped", "budget", "skipped", p, n, one(1.0), "bool", note=res["skipped"])
            continue
        smp, peaks = res["samples"], res["peaks"]
        its = len(smp)
        nt = f"iters={its}" + ("; cut short by --max-seconds" if res["cut"] else "") + f"; {shape}"
        f_fwd = fwd_flops(n, b, hq, d)
        flops = {"fwd": f_fwd, "bwd": 2.5 * f_fwd, "total": 3.5 * f_fwd}
        t_full = {}
        for prov, (_, _, pnote) in env["full"].items():
            for phase, name in (("total", "gpu_fwd_bwd"), ("fwd", "gpu_fwd"), ("bwd", "gpu_bwd")):
                ts = [s["full"][prov][phase] for s in smp]
                add(name, prov, "time", 1, n, stats(ts), "s", note=f"whole sequence; {pnote}; {nt}")
                tf = [flops[phase] / t / 1e12 for t in ts]
                add("gpu_tflops", prov, "fwd_bwd" if phase == "total" else phase, 1, n, stats(tf), "TFLOP/s",
                    note=f"F_fwd = 4*B*Hq*D*N^2/2, bwd 2.5x; {pnote}; {nt}")  # fmt: skip
            t_full[prov] = [s["full"][prov]["total"] for s in smp]
            if prov in peaks:
                mib = peaks[prov] / 2**20
                add("gpu_peak_memory", prov, "max_allocated_growth", 1, n, one(mib), "MiB",
                    note=f"torch.cuda.max_memory_allocated growth over one fwd+bwd, inputs excluded; {pnote}")
        for p in cfg["Ps"]:
            t = n // p
            per = [[s["ring"][p][r] for s in smp] for r in range(p)]  # [rank][iter]
            rnote = f"zigzag rank emulated in one process (no communication), kernel {kernel}, T=N/P={t}; {nt}"
            for phase, name in (("total", "gpu_fwd_bwd"), ("fwd", "gpu_fwd"), ("bwd", "gpu_bwd")):
                mx = [max(r[i][phase] for r in per) for i in range(its)]
                mean = [sum(r[i][phase] for r in per) / p for i in range(its)]
                add(name, "hf_ring_emulated", "time", p, n, stats(mx), "s", note="slowest rank; " + rnote)
                add(name, "hf_ring_emulated", "time.mean_rank", p, n, stats(mean), "s",
                    note="mean over ranks; " + rnote)  # fmt: skip
                tf = [flops[phase] / p / x / 1e12 for x in mx]
                add("gpu_tflops", "hf_ring_emulated", "fwd_bwd" if phase == "total" else phase, p, n, stats(tf),
                    "TFLOP/s", note="(F/P) / slowest rank's time; " + rnote)  # fmt: skip
            mx = [max(r[i]["total"] for r in per) for i in range(its)]
            mean = [sum(r[i]["total"] for r in per) / p for i in range(its)]
            add("gpu_load_balance", "hf_ring_emulated", "max/mean rank time", p, n,
                stats([a / c for a, c in zip(mx, mean)]), "ratio", note=rnote)  # fmt: skip
            for base, tf in t_full.items():
                tag = " (same kernel as the ring)" if base == same else ""
                for metric, tr in (("max_rank", mx), ("mean_rank", mean)):
                    add("gpu_fraction_of_theoretical", "hf_ring_emulated", f"{metric}.vs_{base}", p, n,
                        stats([a / p / c for a, c in zip(tf, tr)]), "ratio",
                        note=f"(t_{base}/P) / t_rank ({metric}), paired per iteration{tag}; {rnote}")  # fmt: skip
            if p in peaks:
                pk = max(peaks[p]) / 2**20
                add("gpu_peak_memory", "hf_ring_emulated", "max_allocated_growth", p, n, one(pk), "MiB",
                    note="max over the emulated ranks of torch.cuda.max_memory_allocated growth over one "
                         "fwd+bwd, inputs excluded; " + rnote)  # fmt: skip
                for base in t_full:
                    if base in peaks and peaks[base] > 0:
                        r = p * max(peaks[p]) / peaks[base]
                        add("gpu_peak_memory", "hf_ring_emulated", f"P*peak_rank/peak_{base}", p, n, one(r), "ratio",
                            note=rnote)
            # overlap: per-step compute of the fastest rank vs the transfer of one hop
            step_f = [min(r[i]["fwd"] for r in per) / p for i in range(its)]
            step_b = [min(r[i]["bwd"] for r in per) / p for i in range(its)]
            tot = [min(r[i]["total"] for r in per) for i in range(its)]
            f_meas = flops["total"] / p / float(np.median(tot))
            msg_f = 2 * b * t * hkv * d * nbytes
            msg_b = 2 * b * t * hkv * d * (nbytes + 4)
            for lname, bw in links.items():
                prov = f"{lname}_{bw:g}GBps"
                thr_f = [t * (msg_f / (bw * 1e9)) / s for s in step_f]
                thr_b = [t * (msg_b / (bw * 1e9)) / s for s in step_b]
                thr = [max(a, c) for a, c in zip(thr_f, thr_b)]
                lnote = (f"T=N/P={t}; BW={bw:g} GB/s per direction; T* = T * t_transfer(T) / t_step(T), "
                         f"t_step = fastest rank's t/P; {nt}")  # fmt: skip
                add("gpu_overlap_threshold", prov, "tokens_per_rank", p, n, stats(thr), "tokens",
                    note="max(forward, backward); " + lnote)
                add("gpu_overlap_threshold", prov, "tokens_per_rank.fwd", p, n, stats(thr_f), "tokens",
                    note="forward: K/V message vs 2*B*Hq*D*T^2 FLOPs per hop; " + lnote)
                add("gpu_overlap_threshold", prov, "tokens_per_rank.bwd", p, n, stats(thr_b), "tokens",
                    note="backward: K/V + fp32 dK/dV messages vs 2.5x forward compute per hop; " + lnote)
                pm = planner_threshold(cfg, n, p, bw, f_meas)
                pdef = planner_threshold(cfg, n, p, bw, None)
                add("gpu_overlap_threshold", prov, "tokens_per_rank.planner_measured_flops", p, n, one(pm), "tokens",
                    note=f"hf_ring.planner.plan(flops={f_meas:.4g} = fastest rank's fwd+bwd "
                         f"throughput, link {bw:g} GB/s)")  # fmt: skip
                add("gpu_overlap_threshold", prov, "tokens_per_rank.planner_default_flops", p, n, one(pdef), "tokens",
                    note=f"hf_ring.planner.plan(flops={PLANNER_DEFAULT_FLOPS / 1e12:g}e12 default, link {bw:g} GB/s)")
                med = float(np.median(thr))
                add("gpu_overlap_hidden", prov, "T>=threshold", p, n, one(float(t >= med)), "bool",
                    note=f"T={t} vs measured threshold {med:.4g}; " + lnote)
                add("gpu_overlap_hidden", prov, "T>=planner_default_threshold", p, n, one(float(t >= pdef)), "bool",
                    note=f"T={t} vs plan() threshold {pdef} at {PLANNER_DEFAULT_FLOPS / 1e12:g} TFLOP/s")
    return tab.rows


def print_table(rows: list[dict], cfg: dict, links: dict) -> None:
    """One console line per (N, P): times, TFLOP/s, fractions of theoretical, memory, overlap thresholds."""
    def get(name, prov, metric, p, n):
        for r in rows:
            if (r["name"], r["provider"], r["metric"], r["P"], r["N"]) == (name, prov, metric, p, n):
                return r["median"]
        return None

    ns = sorted({r["N"] for r in rows if r["name"] == "gpu_fwd_bwd"})
    full = sorted({r["provider"] for r in rows if r["name"] == "gpu_fwd_bwd" and r["provider"] != "hf_ring_emulated"})
    lk = [f"{k}_{v:g}GBps" for k, v in links.items()]
    head = (f"{'N':>7} {'P':>2} {'T':>6} | {'full ms':>9} {'TF/s':>6} | {'rank ms':>9} {'mean ms':>9} {'TF/s':>6} "
            f"{'frac max':>8} {'mean':>6} {'bal':>5} | {'mem P*r/f':>9} | "
            + " ".join(f"{'T*/plan ' + k.split('_')[0]:>17}" for k in lk))  # fmt: skip
    print(head)
    print("-" * len(head))
    same = [r["metric"].split(".vs_")[1] for r in rows if "same kernel" in r["note"]]
    base = same[0] if same else (full[0] if full else "sdpa_full")  # the full call using the ring's kernel
    for n in ns:
        tf = get("gpu_fwd_bwd", base, "time", 1, n)
        fl = get("gpu_tflops", base, "fwd_bwd", 1, n)
        for p in cfg["Ps"]:
            tr = get("gpu_fwd_bwd", "hf_ring_emulated", "time", p, n)
            if tr is None:
                continue
            mem = get("gpu_peak_memory", "hf_ring_emulated", f"P*peak_rank/peak_{base}", p, n)
            thr = []
            for k in lk:
                x = get("gpu_overlap_threshold", k, "tokens_per_rank", p, n)
                pl = get("gpu_overlap_threshold", k, "tokens_per_rank.planner_default_flops", p, n)
                h = get("gpu_overlap_hidden", k, "T>=threshold", p, n)
                thr.append(f"{x:7.3g}/{pl:<6.0f} {'ok' if h else 'NO'}")
            print(f"{n:>7} {p:>2} {n // p:>6} | {1e3 * tf:>9.2f} {fl:>6.3g} | {1e3 * tr:>9.2f} "
                  f"{1e3 * get('gpu_fwd_bwd', 'hf_ring_emulated', 'time.mean_rank', p, n):>9.2f} "
                  f"{get('gpu_tflops', 'hf_ring_emulated', 'fwd_bwd', p, n):>6.3g} "
                  f"{get('gpu_fraction_of_theoretical', 'hf_ring_emulated', 'max_rank.vs_' + base, p, n):>8.3f} "
                  f"{get('gpu_fraction_of_theoretical', 'hf_ring_emulated', 'mean_rank.vs_' + base, p, n):>6.3f} "
                  f"{get('gpu_load_balance', 'hf_ring_emulated', 'max/mean rank time', p, n):>5.3f} | "
                  f"{'-' if mem is None else f'{mem:.2f}':>9} | " + " ".join(f"{s:>17}" for s in thr))  # fmt: skip
    print(f"(full = {base}; frac = (t_full/P)/t_rank, slowest rank / mean rank; bal = max/mean rank time; "
          "mem = P*peak_rank/peak_full; T* = measured overlap threshold, plan = hf_ring.planner.plan's at "
          f"{PLANNER_DEFAULT_FLOPS / 1e12:g} TFLOP/s, tokens per rank; ok: T >= T*)")  # fmt: skip
    for r in rows:
        if r["name"] == "gpu_emulation_check":
            print(f"emulation check N={r['N']} P={r['P']}: {r['metric']} = {r['median']:.2e}")
        if r["name"] == "gpu_skipped" and r["P"] == cfg["Ps"][0]:
            print(f"skipped N={r['N']}: {r['note']}")
