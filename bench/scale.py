"""Scale: the Ray runtime with 100, 1,000 (and, asked for, 10,000) clients on one machine.

Each federation: MNIST, Dir(0.3), 2% of the clients per round, the hyper head, 5 local epochs, batch
40, the default layout (one pooled actor per core), a local Ray of all cores started here. Rounds
0..``--rounds``-1 run through the coordinator actor, driven round by round (``_by_round``), each followed
by an evaluation (G-FL, P-FL of the GM and of every client's PM) and a checkpoint into a fresh run
directory, as ``fedrod-ray train --mode ray`` with ``eval_every: 1`` and ``checkpoint_every: 1`` would. Round 0
(warm-up, and the one full checkpoint) is left out of the medians.

Printed per size: the medians of seconds per round (training), per evaluation and per checkpoint; the
committed state per trained client (its last local model and, for other heads or rules, its P-head and
rule state) and how many clients hold one; the checkpoint files' total size; and the memory (PSS) of all
Ray processes and of the driver at the end. "per extra client" divides the growth of the Ray processes'
PSS from the smallest size by the clients added: with the same dataset, that is what a client costs.
A last row runs the smallest federation with as many clients per round as the largest, since a
checkpoint writes the states of the round's clients.

With ``--s3``, checkpoints also go into ``s3://`` on moto's S3 server started on loopback (the tests'
server, through pyarrow's S3 filesystem as a user's bucket would be), and the rounds after the first come
in ``--rounds`` - 1 pairs: the first of a pair is saved into S3 in the background, as a run saves
(``checkpoint.BackgroundSaves``), while the second trains; the second is then saved on the round's path,
on local disk and into S3, each waited for (every round is saved locally on the path). The last table compares the two saves with the round, and
gives what the round loop still waits for with the background save (the snapshot's handover and the rest
of the save) and the round's time with a save in flight against one without, the two kinds interleaved
so that a changing load on the machine weighs on both alike.

    FEDROD_DATA_DIR=../shared/data python bench/scale.py                       # 100 and 1,000 clients
    FEDROD_DATA_DIR=../shared/data python bench/scale.py --clients 100 1000 10000
    FEDROD_DATA_DIR=../shared/data python bench/scale.py --clients 1000 --rounds 4 --s3   # local vs S3
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # before anything imports ray
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local Ray: nothing written to ~/.ray

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import ray
from _by_round import Coordinator
from _common import machine_note, make_config, md_table, median, mnist_data_section, ray_memory

from fedrod_ray.federation_state.setup import prepare

NEVER = 10**6


S3_BUCKET = "fedrod-bench"


def run(args, data: dict, num_clients: int, fraction: float, workdir: Path) -> dict:
    cfg = make_config(
        data | {"num_clients": num_clients, "partition": "dirichlet", "alpha": 0.3},
        name=f"scale_{num_clients}", seed=args.seed,
        train={"head": args.head, "rounds": NEVER, "client_fraction": fraction, "local_epochs": 5,
               "batch_size": 40},
        eval={"eval_every": 1},
        runtime={"torch_threads": 1},
    )
    setup = prepare(cfg)
    run_dir = workdir / f"run_{num_clients}"
    s3_uri = f"s3://{S3_BUCKET}/run_{num_clients}_{fraction}"
    coordinator = Coordinator.options(num_cpus=0, max_concurrency=2).remote(setup)

    def save_on_the_path(uri: str) -> float:
        """Seconds for a save started and waited for: what it costs the round loop in line."""
        t0 = time.perf_counter()
        ray.get(coordinator.save_checkpoint.remote(uri))
        ray.get(coordinator.wait_checkpoint.remote())
        return time.perf_counter() - t0

    try:
        rounds, evals, checkpoints, s3_checkpoints = [], [], [], []
        plain, in_flight, waits = [], [], []  # with --s3: round seconds without and with a save in flight
        for r in range(2 * args.rounds - 1 if args.s3 else args.rounds):
            rec = ray.get(coordinator.step.remote(r))
            line = (f"  {num_clients} clients, round {r + 1}: train {rec['train_seconds']:.2f} s, evaluation "
                    f"{rec['seconds'] - rec['train_seconds']:.2f} s")
            if args.s3 and r % 2:
                # Nothing in flight: this round's save goes into S3 in the background, as a run saves, and
                # the next round trains while it is written. (Saved locally too, so that every save of
                # either writer holds one round's clients.)
                checkpoints.append(save_on_the_path(str(run_dir)))
                t0 = time.perf_counter()
                ray.get(coordinator.save_checkpoint.remote(s3_uri))
                waits.append(time.perf_counter() - t0)
                plain.append(rec["seconds"])
                rounds.append(rec["train_seconds"])
                evals.append(rec["seconds"] - rec["train_seconds"])
                print(f"{line}; checkpoint {checkpoints[-1]:.3f} s, into S3 handed over in {waits[-1]:.3f} s",
                      flush=True)
                continue
            if args.s3 and r:
                # Trained with the save before in flight: what the round loop then waits for is its rest.
                t0 = time.perf_counter()
                ray.get(coordinator.wait_checkpoint.remote())
                waits[-1] += time.perf_counter() - t0
                in_flight.append(rec["seconds"])
                line += f" with a save in flight, then waited {waits[-1]:.3f} s in all for it"
            local = save_on_the_path(str(run_dir))
            s3 = save_on_the_path(s3_uri) if args.s3 else None
            if r:
                checkpoints.append(local)
                if args.s3:
                    s3_checkpoints.append(s3)
                else:
                    rounds.append(rec["train_seconds"])
                    evals.append(rec["seconds"] - rec["train_seconds"])
            print(f"{line}; checkpoint {local:.3f} s" + (f", on S3 {s3:.3f} s" if args.s3 else "")
                  + f", P-FL PM {rec['pfl_pm']:.4f}", flush=True)
        memory = ray_memory()
        states = ray.get(coordinator.snapshot.remote()).clients
        ray.get(coordinator.close.remote())
    finally:
        ray.kill(coordinator)
    held = [st.nbytes for st in states.values() if st.nbytes]
    ckpt_bytes = sum(p.stat().st_size for p in (run_dir / "checkpoints").rglob("*") if p.is_file())
    shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "clients": num_clients, "per_round": round(num_clients * fraction), "round": median(rounds), "eval": median(evals), "ckpt": median(checkpoints),
        "s3_ckpt": median(s3_checkpoints) if s3_checkpoints else None,
        "in_flight": median(in_flight) if in_flight else None, "plain": median(plain) if plain else None,
        "wait": median(waits) if waits else None,
        "state": sum(held) / max(len(held), 1), "holding": len(held), "ckpt_bytes": ckpt_bytes,
        "ray_pss": sum(pss for kind, (_, _, pss) in memory.items() if kind != "driver"),
        "driver_pss": memory["driver"][2],
    }


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--rounds", type=int, default=6,
                   help="rounds per size (with --s3, 1 + 2 x (rounds - 1)); the first is not timed")
    p.add_argument("--fraction", type=float, default=0.02)
    p.add_argument("--head", default="hyper", choices=["none", "linear", "hyper"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--s3", action="store_true",
                   help="also checkpoint into moto's S3 server, in the background and on the round's path")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    print(machine_note())
    data = mnist_data_section(os.environ.get("FEDROD_DATA_DIR"))
    workdir = Path(tempfile.mkdtemp(prefix="fedrod-scale-"))
    with contextlib.ExitStack() as stack:
        env = {}
        if args.s3:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from servers import s3_server

            env = stack.enter_context(s3_server(workdir))
            os.environ.update(env)
            import boto3

            boto3.client("s3").create_bucket(Bucket=S3_BUCKET)
        return measure(args, data, workdir, env)


def measure(args, data: dict, workdir: Path, env: dict) -> int:
    ray.init(address="local", include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        results = [run(args, data, n, args.fraction, workdir) for n in args.clients]
        # The smallest federation again with as many clients per round as the largest: a checkpoint
        # writes the round's clients, so this separates the round's size from the federation's.
        most = round(max(args.clients) * args.fraction)
        if most > round(min(args.clients) * args.fraction):
            results.append(run(args, data, min(args.clients), most / min(args.clients), workdir))
    finally:
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    base = results[0]
    rows = []
    for res in results:
        extra = res["clients"] - base["clients"]
        per_client = f"{(res['ray_pss'] - base['ray_pss']) / extra / 2**10:.0f} KiB" if extra else "-"
        rows.append([
            res["clients"], res["per_round"], f"{res['round']:.2f}", f"{res['eval']:.2f}", f"{res['ckpt']:.3f}",
            f"{res['ckpt'] / base['ckpt']:.2f}", f"{res['state'] / 2**10:.0f} KiB", res["holding"],
            f"{res['ckpt_bytes'] / 2**20:.1f}", f"{res['ray_pss'] / 2**20:.0f}", per_client,
            f"{res['driver_pss'] / 2**20:.0f}",
        ])
    print(f"\nMNIST, Dir(0.3), {args.fraction:.0%} of the clients per round (last row: the smallest federation "
          f"with the largest one's clients per round), head {args.head}, 5 local epochs, batch 40; medians of "
          + ("the rounds with no save in flight and of the saves on the round's path (below)" if args.s3 else
             f"rounds 2..{args.rounds}") + "; 'vs first' and 'per extra client' against the first row:\n")
    print(md_table("clients|per round|s / round|s / evaluation|s / checkpoint|checkpoint vs first|committed state "
                   "per trained client|clients holding state|checkpoint files MiB|Ray processes PSS MiB|"
                   "PSS per extra client|driver PSS MiB", rows))
    if args.s3:
        print("\nWith --s3, rounds in pairs after the first: the first of a pair trains with no save in flight and "
              "its save goes into S3 in the background, as a run saves; the second trains while that save is "
              "written, then waits for what is left of it, then is saved on the round's path (started and waited "
              "for) on local disk and on the S3 server (moto on loopback). Medians over the pairs; 'waited' is all "
              "the round loop waited for a background save (the handover and the rest of the save):\n")
        print(md_table("clients|per round|s / round|local save, s|share of round|S3 save, s|share of round|"
                       "S3 vs local|s / round, S3 save in flight|vs no save in flight|waited for the S3 save, s|"
                       "share of round|S3 save on the path vs waited", [
            [res["clients"], res["per_round"], f"{res['plain']:.2f}", f"{res['ckpt']:.3f}",
             f"{res['ckpt'] / res['plain']:.1%}", f"{res['s3_ckpt']:.3f}", f"{res['s3_ckpt'] / res['plain']:.1%}",
             f"{res['s3_ckpt'] / res['ckpt']:.1f}x", f"{res['in_flight']:.2f}", f"{res['in_flight'] / res['plain']:.2f}x",
             f"{res['wait']:.3f}", f"{res['wait'] / res['plain']:.1%}", f"{res['s3_ckpt'] / res['wait']:.0f}x"]
            for res in results]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
