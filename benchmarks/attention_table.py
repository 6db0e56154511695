"""The attention benchmark's long table: per-rank samples of ``benchmarks.bench_attention`` -> rows.

Row names and metrics are defined in ``benchmarks/NOTES.md`` ("What is measured"); ``build_rows``
is also used by ``bench_attention --resume`` to rebuild the table from the raw samples.
"""

from __future__ import annotations

import numpy as np

from benchmarks.harness import Table, per_iter_max, stats, threads_per_rank


def _mem_iters(per: list[list[dict]], incl: bool) -> list[float]:
    """Per repeat, the max over ranks of the RSS growth in MiB (``incl``: plus the local inputs)."""
    return [max(s[i]["growth_kib"] / 1024 + (s[i]["input_bytes"] / 2**20 if incl else 0) for s in per)
            for i in range(len(per[0]))]  # fmt: skip


def build_rows(timing: dict, memory: dict, cfg: dict, meta: dict) -> list[dict]:
    """``timing[P][N][rank][provider][iter]`` and ``memory[P][N][rank][provider][repeat]`` -> the long table."""
    total_threads = cfg["threads"]
    tab = Table(meta, lambda p: threads_per_rank(total_threads, p))
    for p in cfg["Ps"]:
        load = meta["load"].get(p)
        lnote = f"foreign CPU load during this P's run {100 * load:.0f}% of the machine" if load is not None else ""
        for n in cfg["Ns"]:
            ranks = timing[p][str(n)]  # [rank][provider][iter]
            iters = len(ranks[0]["hf_ring"])
            nt = f"iters={iters}"
            if "_foreign" in ranks[0]:
                fk = ranks[0]["_foreign"]
                nt += (f"; foreign CPU load in kept iterations median {100 * float(np.median(fk)):.0f}% "
                       f"max {100 * max(fk):.0f}%, {ranks[0]['_redone']} iteration(s) redone")  # fmt: skip
            elif lnote:
                nt += f"; {lnote}"
            if "_foreign" in ranks[0]:
                tab.add("machine_load", "other_processes", "foreign_cpu_fraction_kept_iters", p, n,
                        stats(ranks[0]["_foreign"]), "fraction",
                        note=f"CPU used by other processes / (wall x cores), per kept iteration; "
                             f"{ranks[0]['_redone']} iteration(s) redone")  # fmt: skip
            # single-process SDPA baseline, measured on rank 0 between the ring runs of this P
            sdpa = {}
            for prov, thr in (("sdpa", total_threads), ("sdpa_1thread", 1)):
                if prov not in ranks[0]:
                    continue
                samp = ranks[0][prov]
                for phase in ("total", "fwd", "bwd"):
                    name = "fwd_bwd" if phase == "total" else phase
                    tab.add(name, prov, "time", p, n, stats([s[phase] for s in samp]), "s", threads=thr,
                            note=f"one process, whole sequence, {thr} thread(s); run on rank 0 between the P={p} "
                                 f"ring runs while the other ranks sleep; {nt}")  # fmt: skip
                sdpa[prov] = [s["total"] for s in samp]
            t_ring = {}
            for prov in ("hf_ring", "hf_ring_contiguous", "torch_ring", "hf_ring_nocomm"):
                if prov not in ranks[0]:
                    continue
                per_rank = [r[prov] for r in ranks]
                for phase in ("total", "fwd", "bwd"):
                    name = "fwd_bwd" if phase == "total" else phase
                    tab.add(name, prov, "time", p, n, stats(per_iter_max(per_rank, phase)), "s", note=tab.note(p, nt))
                t_ring[prov] = per_iter_max(per_rank, "total")
            # efficiency vs single-process SDPA with all threads, paired per iteration
            for prov in ("hf_ring", "torch_ring", "hf_ring_contiguous"):
                if prov in t_ring:
                    eff = [a / b for a, b in zip(sdpa["sdpa"], t_ring[prov])]
                    tab.add("efficiency", prov, "t_sdpa/t_ring", p, n, stats(eff), "ratio",
                            note=tab.note(p, f"t_sdpa: one process, whole sequence, {total_threads} threads; "
                                             "ratio paired per iteration; " + nt))  # fmt: skip
            if "sdpa_1thread" in sdpa:
                sc = [a / b for a, b in zip(sdpa["sdpa_1thread"], sdpa["sdpa"])]
                tab.add("sdpa_thread_scaling", "sdpa", f"t_1thread/t_{total_threads}threads", p, n, stats(sc), "ratio",
                        threads=total_threads, note="paired per iteration; " + nt)  # fmt: skip
            if "torch_ring" in t_ring:
                ratio = [a / b for a, b in zip(t_ring["torch_ring"], t_ring["hf_ring"])]  # same iteration
                tab.add("vs_torch_ring", "hf_ring", "t_torch_ring/t_hf_ring", p, n, stats(ratio), "ratio",
                        note=tab.note(p, "paired per iteration; " + nt))  # fmt: skip
            # CPU-time companions (robust to other processes sharing the cores): main-thread CPU
            # seconds, max over ranks, per iteration
            cpu = {}
            for prov in ("hf_ring", "torch_ring"):
                if prov in ranks[0] and "cpu" in ranks[0][prov][0]:
                    cpu[prov] = per_iter_max([r[prov] for r in ranks], "cpu")
            if len(cpu) == 2:
                ratio = [a / b for a, b in zip(cpu["torch_ring"], cpu["hf_ring"])]
                tab.add("vs_torch_ring_cpu", "hf_ring", "cpu_torch_ring/cpu_hf_ring", p, n, stats(ratio), "ratio",
                        note=tab.note(p, "main-thread CPU s, max over ranks, paired per iteration; " + nt))  # fmt: skip
            one = timing.get(1, {}).get(str(n))
            if p > 1 and one and "sdpa_1thread" in one[0] and "cpu" in one[0]["sdpa_1thread"][0]:
                ref = float(np.median([s["cpu"] for s in one[0]["sdpa_1thread"]]))
                for prov, c in cpu.items():
                    tab.add("efficiency_cpu", prov, "cpu_sdpa_1thread/(P*max_rank_cpu)", p, n,
                            stats([ref / (p * x) for x in c]), "ratio",
                            note=tab.note(p, "work efficiency: CPU s of 1-thread SDPA over the whole sequence "
                                             "(P=1 run, median) / (P x max-rank main-thread CPU s of the ring); "
                                             "independent of thread scaling and of other processes; " + nt))
            # load balance: per-rank compute = main-thread CPU seconds of fwd+bwd
            if p > 1:
                for prov in ("hf_ring", "hf_ring_contiguous", "hf_ring_nocomm"):
                    per_rank = [r[prov] for r in ranks]
                    for rk, samp in enumerate(per_rank):
                        tab.add("rank_compute", prov, f"cpu_s.rank{rk}", p, n, stats([s["cpu"] for s in samp]), "s",
                                note=tab.note(p, f"rank {rk}; main-thread CPU time of fwd+bwd; " + nt))  # fmt: skip
                    ratios = []
                    for i in range(iters):
                        c = [r[i]["cpu"] for r in per_rank]
                        ratios.append(max(c) / (sum(c) / len(c)))
                    tab.add("load_balance", prov, "max/mean rank compute", p, n, stats(ratios), "ratio",
                            note=tab.note(p, f"ideal contiguous 2P/(P+1) = {2 * p / (p + 1):.3f}; " + nt))  # fmt: skip
                # communication hiding
                t_nc = t_ring["hf_ring_nocomm"]
                t_cm = per_iter_max([r["comm_alone"] for r in ranks], "total")
                exposed = [a - b for a, b in zip(t_ring["hf_ring"], t_nc)]
                waits = [sum(r["hf_ring"][i]["wait"] for r in ranks) / p for i in range(iters)]
                e_med, e20, e80 = stats(exposed)
                c_med, c20, c80 = stats(t_cm)
                w_med, w20, w80 = stats(waits)
                tab.add("comm", "hf_ring", "t_ring", p, n, stats(t_ring["hf_ring"]), "s", note=tab.note(p, nt))
                tab.add("comm", "hf_ring", "t_nocomm", p, n, stats(t_nc), "s", note=tab.note(p, nt))
                tab.add("comm", "hf_ring", "t_comm_alone", p, n, (c_med, c20, c80), "s",
                        note=tab.note(p, f"{p - 1} K/V hops fwd + the bwd hops, no compute; {len(t_cm)} samples"))
                tab.add("comm", "hf_ring", "exposed", p, n, (e_med, e20, e80), "s",
                        note=tab.note(p, "t_ring - t_nocomm, paired per iteration; " + nt))
                tab.add("comm", "hf_ring", "wait", p, n, (w_med, w20, w80), "s",
                        note=tab.note(p, "wall time inside RingComm.wait, mean over ranks; " + nt))
                tab.add("comm", "hf_ring", "hidden_fraction", p, n,
                        (1 - e_med / c_med, 1 - e80 / c_med, 1 - e20 / c_med), "fraction",
                        note=tab.note(p, "1 - (t_ring - t_nocomm)/t_comm_alone; p20/p80 from exposed p80/p20"))
                tab.add("comm", "hf_ring", "hidden_fraction_wait", p, n,
                        (1 - w_med / c_med, 1 - w80 / c_med, 1 - w20 / c_med), "fraction",
                        note=tab.note(p, "1 - (mean wait in RingComm.wait)/t_comm_alone"))
                frac = [e / t for e, t in zip(exposed, t_ring["hf_ring"])]
                tab.add("comm", "hf_ring", "exposed_fraction_of_t_ring", p, n, stats(frac), "fraction",
                        note=tab.note(p, "(t_ring - t_nocomm)/t_ring, paired per iteration: the ring's whole cost "
                                         "beyond its compute; " + nt))  # fmt: skip
                reps = max(1, len(t_cm) // max(1, iters))
                t_cm_it = [float(np.median(t_cm[i * reps : (i + 1) * reps])) for i in range(iters)]
                frac = [c / t for c, t in zip(t_cm_it, t_ring["hf_ring"])]
                tab.add("comm", "hf_ring", "comm_alone_fraction_of_t_ring", p, n, stats(frac), "fraction",
                        note=tab.note(p, "t_comm_alone/t_ring: what there is to hide; " + nt))

    for p in cfg["Ps"]:
        if p in meta["load"]:
            v = meta["load"][p]
            tab.add("machine_load", "other_processes", "foreign_cpu_fraction", p, 0, (v, v, v), "fraction", x=p,
                    note="CPU used by processes outside this benchmark during the P run / (wall x cores)")

    # memory, x = P
    base: dict = {}
    for p in cfg["Ps"]:
        for n in cfg["Ns"]:
            if str(n) not in memory.get(p, {}):
                continue
            ranks = memory[p][str(n)]
            for prov in ranks[0]:
                per = [r[prov] for r in ranks]
                growth, incl = _mem_iters(per, False), _mem_iters(per, True)
                ok = all(s[i]["hwm_reset"] for s in per for i in range(len(per[0])))
                mnote = "peak RSS growth across one fwd+bwd, max over ranks; MALLOC_MMAP_THRESHOLD_=65536" + (
                    "" if ok else "; WARNING: VmHWM reset failed, growth is since process start")
                thr = total_threads if prov == "sdpa" else None
                tab.add("peak_memory", prov, "rss_growth", p, n, stats(growth), "MiB", x=p, threads=thr,
                        note=tab.note(p, mnote) if prov != "sdpa" else mnote + "; whole sequence, one process")
                tab.add("peak_memory", prov, "rss_growth_incl_inputs", p, n, stats(incl), "MiB", x=p, threads=thr,
                        note=tab.note(p, mnote + " + local q,k,v,dout") if prov != "sdpa" else mnote)
                if p == 1 and prov == "hf_ring":
                    base[n] = (float(np.median(growth)), float(np.median(incl)))
            for prov in ranks[0]:
                if prov == "sdpa" or n not in base:
                    continue
                per = [r[prov] for r in ranks]
                r1 = float(np.median(_mem_iters(per, False))) * p / base[n][0]
                r2 = float(np.median(_mem_iters(per, True))) * p / base[n][1]
                tab.add("memory_scaling", prov, "peak_P*P/peak_1(hf_ring)", p, n, (r1, r1, r1), "ratio", x=p,
                        note=tab.note(p, "RSS growth; target <= 1.1"))
                tab.add("memory_scaling", prov, "peak_incl_inputs_P*P/peak_1(hf_ring)", p, n, (r2, r2, r2), "ratio",
                        x=p, note=tab.note(p, "RSS growth + local inputs; target <= 1.1"))
    return tab.rows
