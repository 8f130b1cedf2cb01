"""Train a DLRM and serve it while it trains: one process trains with the
veloce.serving.Publish callback into a FileStore, a second one (started here) serves it.

    python examples/train_and_serve.py                     # 200k samples, a version every 20 steps
    python examples/train_and_serve.py --samples 2000000 --every 100 --store /tmp/ctr

The training process (veloce.Trainer, synthetic clicks) publishes a full snapshot at the
first publication and deltas after it (only the rows changed, the dense layers whole),
every --every optimizer steps and at the end. The serving process builds the model's
inference twin from a freshly constructed DLRM and the store (veloce.serving.inference_twin),
then keeps calling veloce.serving.refresh and prints the version it serves and its click
probability for one fixed request. When training ends, the trainer prints its own
prediction for the same request and the last version; the server, once it serves that
version, prints the same number (exactly: fp32 rows) and exits.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

import veloce
from veloce.data import SyntheticClicks
from veloce.models import DLRM
from veloce.serving import FileStore, Publish, VersionMissing, inference_twin, refresh

NUM_DENSE, NUM_SPARSE, DIM = 13, 26, 16


def build_model() -> DLRM:
    """The architecture both processes construct (the server only for its structure)."""

    def table(dim: int) -> veloce.DynamicEmbedding:
        return veloce.DynamicEmbedding(dim, mode="sum", capacity=1 << 14, initializer=veloce.init.normal(std=0.01),
                                       optimizer=veloce.optim.Adagrad(lr=0.05))  # fmt: skip

    return DLRM(NUM_DENSE, NUM_SPARSE, embedding_dim=DIM, embedding_factory=table)


def request() -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed request (dense and sparse features of one sample) both processes score."""
    (dense, sparse), _ = next(iter(SyntheticClicks(1, batch_size=1, seed=7, start=10**9)))
    return dense, sparse


def predict(model: torch.nn.Module) -> float:
    model.eval()
    with torch.no_grad():
        return torch.sigmoid(model(*request())).item()


def serve(store_path: str, poll: float) -> None:
    """The serving process: waits for the first version, then serves and refreshes until
    it serves the version named in ``<store>/final`` (written when training ends)."""
    store, final = FileStore(store_path), Path(store_path) / "final"
    while not store.committed():
        time.sleep(poll)
    twin = inference_twin(build_model(), store)
    served = None
    while True:
        try:
            version = refresh(twin)
        except VersionMissing:  # the version read was superseded meanwhile: the next refresh moves on
            continue
        if version != served:
            served = version
            print(f"[server] serving version {version}: p(click) = {predict(twin):.6f}", flush=True)
        if final.exists() and int(final.read_text()) == served:
            print(f"[server] final version {served}: p(click) = {predict(twin):.9f}", flush=True)
            return
        time.sleep(poll)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=200_000, help="training samples (one epoch)")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--every", type=int, default=20, help="publish every this many optimizer steps")
    p.add_argument("--store", default="runs/train_and_serve/store", help="the FileStore's directory (emptied)")
    p.add_argument("--poll", type=float, default=0.2, help="seconds between the server's refreshes")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the serving process
    args = p.parse_args()
    if args.serve:
        serve(args.store, args.poll)
        return

    shutil.rmtree(args.store, ignore_errors=True)
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--store", args.store, "--poll", str(args.poll)])
    try:
        torch.manual_seed(0)
        model = build_model()
        publish = Publish(FileStore(args.store), every_n_steps=args.every, keep_last=3, fold_every=10)
        trainer = veloce.Trainer(model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), progress=False,
                                 callbacks=[publish])  # fmt: skip
        trainer.fit(SyntheticClicks(args.samples, batch_size=args.batch, seed=0))
        print(f"[trainer] {trainer.global_step} steps, published versions {[v for _, v in publish.published]}; "
              f"final version {publish.version}: p(click) = {predict(model):.9f}", flush=True)  # fmt: skip
        tmp = Path(args.store) / "final.tmp"
        tmp.write_text(str(publish.version))
        tmp.replace(Path(args.store) / "final")  # whole, for the server to read
        if server.wait(timeout=300) != 0:
            raise SystemExit(f"the serving process failed (exit status {server.returncode})")
    finally:
        if server.poll() is None:
            server.kill()


if __name__ == "__main__":
    main()
