"""Diloco recipes at equal samples in one process, without the network: which H, inner batch, codec,
outer optimizer and error-feedback decay reach what validation loss, in minutes instead of hours.

Each recipe trains ``--peers`` replicas in turn from the same synced weights for H inner steps on their
own batches (the public seeds of ``derive_seed``); each replica is the trainer's own DiLoCo strategy
(``swarm.training.diloco.DilocoSync``: inner steps, pseudo-gradient, error feedback, outer step,
overlap). The script encodes each pseudo-gradient with the run's codec, aggregates the decoded
contributions with the run's rule (``centered_clip``, equal weights), encodes the result once as a
reducer does, and applies it with the run's outer optimizer; ``every_step`` takes one optimizer step
per ``peers * batch`` samples on the mean gradient. Model, data, schedule, clipping,
codecs, optimizers and aggregator are the swarm's own (``build_run`` of ``swarm-sim``); what is left
out is everything the network adds: matchmaking, windows that close on other peers' progress,
stragglers, attackers, bytes. The swarm's own figures come from ``bench_diloco.py``; this script is
where a recipe is chosen before such a run.

Recipes are written as ``every_step`` or ``CODEC H=100 [batch=28] [outer=LR:MOMENTUM] [decay=0.95]
[density=0.01] [overlap] [peers=N] [windows=W] [rule=NAME] [attack=NAME f=K] [inner=keep|reset]`` (outer and decay default to
the run's, which depend on the codec; see docs/diloco.md; ``peers`` overrides ``--peers``; ``windows`` fixes
the outer steps instead of ``--samples``, so that a run of only the honest peers is an anchor at the same
outer steps; ``rule`` is a registered aggregator, the run's by default). ``attack=NAME f=K``: the last K peers train honestly and send what
that attack of ``swarm.byzantine`` makes of their honest pseudo-gradient, at the weight it claims (the
omniscient attacks get every peer's honest pseudo-gradient, as the public seeds give them). The rule is
applied per chunk of each reducer's part, as a round of that many members cuts the vector, and each row
prints the honest pseudo-gradients' mean pairwise cosine and the aggregate's cosine to their mean.

Every recipe processes ``--samples`` samples (diloco: ``samples / (peers * H * batch)``
windows, rounded); ``--repeat`` rounds interleave the recipes (A, B, A, B...) and each round draws other
batches. ``overlap`` replays ``outer_overlap``: each window's round lands at the end of the next window,
so W windows apply W - 1 outer steps (the last window's round would land in a window the run no longer
has), and each replica moves onto the new synced copy less its own newest window, as the trainer does.

Usage::

    python benchmarks/diloco_recipes.py --samples 11200 --recipes "every_step" "int8 H=100" "int8 H=100 outer=1:0"
    python benchmarks/diloco_recipes.py --quick                       # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lab.sim import eval_batches, validation_loss  # noqa: E402
from lab.simconfig import PRESETS, SimConfig, build_run, parse_outer_optimizer  # noqa: E402
from protocols.errors import ProtocolError  # noqa: E402
from swarm.averaging.aggregators import AGGREGATORS, get_aggregator  # noqa: E402
from swarm.averaging.allreduce import RoundResult  # noqa: E402
from swarm.averaging.compression import get_codec  # noqa: E402
from swarm.averaging.evidence import chunk_bounds, layout_chunk_values, split_bounds  # noqa: E402
from swarm.byzantine.attacks import attack_names, make_attack  # noqa: E402
from swarm.data import build_dataset  # noqa: E402
from swarm.data.seeds import derive_seed  # noqa: E402
from swarm.models import build_model  # noqa: E402
from swarm.training.diloco import DilocoSync  # noqa: E402
from swarm.training.state import (  # noqa: E402
    build_optimizer,
    clip_gradients,
    learning_rate,
    set_learning_rate,
)

DEFAULT_RECIPES = ["every_step", "int8 H=100", "int8 H=100 outer=1:0"]
QUICK_RECIPES = ["every_step", "int8 H=10", "topk H=10", "int8 H=10 overlap"]
KEYS = {
    "H": int,
    "batch": int,
    "decay": float,
    "density": float,
    "peers": int,
    "windows": int,
    "f": int,
    "rule": str,
    "attack": str,
    "inner": str,
}


def parse_recipe(text: str, default_batch: int, default_peers: int) -> dict:
    words = text.split()
    if words == ["every_step"]:
        return {"name": text, "sync": "every_step", "batch": default_batch, "peers": default_peers}
    if not words or words[0] not in ("fp16", "none", "int8", "topk"):
        raise SystemExit(f"recipe {text!r}: start with every_step or a codec (fp16, none, int8, topk)")
    recipe = {"name": text, "sync": "diloco", "codec": words[0], "batch": default_batch, "H": 100}
    recipe["peers"] = default_peers
    for word in words[1:]:
        key, _, value = word.partition("=")
        try:
            if word == "overlap":
                recipe["overlap"] = True
            elif key == "outer":
                recipe["outer"] = parse_outer_optimizer(value)
            elif key in KEYS:
                recipe[key] = KEYS[key](value)
            else:
                raise ValueError
        except ValueError:
            raise SystemExit(
                f"recipe {text!r}: cannot read {word!r} "
                "(keys: H, batch, outer, decay, density, peers, windows, rule, attack, f, inner; or overlap)"
            ) from None
    if recipe.get("inner", "keep") not in ("keep", "reset"):
        raise SystemExit(f"recipe {text!r}: inner is keep or reset, not {recipe['inner']!r}")
    if recipe.get("rule") is not None and recipe["rule"] not in AGGREGATORS.names():
        raise SystemExit(f"recipe {text!r}: unknown rule {recipe['rule']!r}; known: {AGGREGATORS.names()}")
    if recipe.get("attack") is not None and recipe["attack"] not in attack_names():
        raise SystemExit(f"recipe {text!r}: unknown attack {recipe['attack']!r}; known: {attack_names()}")
    if ("attack" in recipe) != ("f" in recipe) or not 0 < recipe.get("f", 1) < recipe["peers"]:
        raise SystemExit(f"recipe {text!r}: attack=NAME needs f=K, with 0 < K < the recipe's peers")
    return recipe


def _gradient_step(model, dataset, seed: int, batch: int, seq_len: int) -> None:
    inputs, targets = dataset.sample_batch(seed, batch, seq_len)
    model.loss(inputs, targets).backward()


def chunked(rule, codec, members: int):
    """``rule`` applied as a round of ``members`` applies it: per chunk of each reducer's part."""
    chunk_values = layout_chunk_values(members, codec.bytes_per_value)

    def aggregate(rows: torch.Tensor, weights: torch.Tensor, *, seed: int) -> torch.Tensor:
        bounds, pieces = split_bounds(rows.shape[1], members), []
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            chunks = chunk_bounds(hi - lo, chunk_values)
            for a, b in zip(chunks, chunks[1:], strict=False):
                if b > a:
                    pieces.append(rule(rows[:, lo + a : lo + b].contiguous(), weights, seed=seed))
        return torch.cat(pieces)

    return aggregate


def _spread(honest: torch.Tensor, result: torch.Tensor) -> tuple[float, float, float]:
    """The honest rows' mean pairwise cosine, and the result's cosine to their mean and norm over its."""
    unit = torch.nn.functional.normalize(honest.to(torch.float64), dim=1)
    n = unit.shape[0]
    pairwise = float(((unit @ unit.T).sum() - n) / max(1, n * (n - 1)))
    mean = honest.to(torch.float64).mean(0)
    cosine = float(torch.nn.functional.cosine_similarity(result.to(torch.float64), mean, dim=0))
    return pairwise, cosine, float(result.norm() / mean.norm().clamp_min(1e-30))


class Lab:
    def __init__(self, args) -> None:
        self.args = args
        self.shape = {**PRESETS[args.model_size]}
        self.seq_len = self.shape.get("seq_len", 256)
        run = build_run(SimConfig(peers=args.peers, steps=1, model_size=args.model_size, lr=args.lr))
        self.dataset = build_dataset(run.dataset.name, run.dataset.config)
        self.validation = eval_batches(self.dataset, self.seq_len)  # what swarm-sim judges runs on
        initial = build_model("gpt", self.shape, seed=run.training.seed)
        self.initial_val_loss = validation_loss(initial, self.validation)

    def run(self, recipe: dict, round_index: int) -> dict:
        started = time.perf_counter()
        tag = f"lab{round_index}"
        if recipe["sync"] == "every_step":
            (loss, steps), spread = self._every_step(recipe, tag), []
        else:
            loss, steps, spread = self._diloco(recipe, tag)
        return {
            **recipe,
            "round": round_index,
            "val_loss": loss,
            "initial_val_loss": self.initial_val_loss,
            "steps": steps,
            "s": time.perf_counter() - started,
            # per window: the honest pseudo-gradients' mean pairwise cosine, the aggregate's cosine to their
            # mean, and its norm over their mean's
            "spread": spread,
        }

    def _sim(self, recipe: dict, steps: int):
        outer = recipe.get("outer")
        return build_run(
            SimConfig(
                peers=recipe["peers"],
                steps=steps,
                model_size=self.args.model_size,
                lr=self.args.lr,
                sync=recipe["sync"],
                inner_steps=recipe.get("H", 1),
                compression=recipe.get("codec", "fp16"),
                outer_lr=outer[0] if outer else None,
                outer_momentum=outer[1] if outer else None,
            )  # fmt: skip
        )

    def _every_step(self, recipe: dict, tag: str) -> tuple[float, int]:
        peers, batch = recipe["peers"], recipe["batch"]
        steps = max(1, round(self.args.samples / (peers * batch)))
        run = self._sim(recipe, steps)
        model = build_model("gpt", self.shape, seed=run.training.seed)
        optimizer = build_optimizer(model, run.optimizer)
        for step in range(steps):
            for peer in range(peers):
                _gradient_step(
                    model, self.dataset, derive_seed(tag, f"peer{peer}", step), batch, self.seq_len
                )
            for p in model.parameters():
                p.grad.div_(peers)
            clip_gradients(model, run.optimizer.grad_clip_norm)
            set_learning_rate(optimizer, learning_rate(run.optimizer, step))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return validation_loss(model, self.validation), steps

    def _diloco(self, recipe: dict, tag: str) -> tuple[float, int, list[tuple[float, float, float]]]:
        peers, batch, inner_steps = recipe["peers"], recipe["batch"], recipe["H"]
        outer_steps = recipe.get("windows") or max(
            1, round(self.args.samples / (peers * inner_steps * batch))
        )
        run = self._sim(recipe, outer_steps)
        training = run.training
        training.topk_feedback_decay = recipe.get("decay", training.topk_feedback_decay)
        training.topk_density = recipe.get("density", training.topk_density)
        training.outer_overlap = recipe.get("overlap", False)
        training.inner_optimizer_state = recipe.get("inner", training.inner_optimizer_state)
        codec = get_codec(recipe["codec"], topk_density=training.topk_density)
        rule = recipe.get("rule", training.aggregator)
        options = training.aggregator_options if rule == training.aggregator else None
        aggregate = chunked(get_aggregator(rule, options), codec, peers)
        attackers = recipe.get("f", 0)
        attacks = [
            make_attack(recipe["attack"], group_size=peers, attackers=attackers, seed=i)
            for i in range(attackers)
        ]  # fmt: skip
        # Each peer is the trainer's own DiLoCo strategy: inner steps, pseudo-gradient, error feedback,
        # outer step and overlap; each holds a synced copy, as every peer of a run does.
        peers_ = []
        for _ in range(peers):
            model = build_model("gpt", self.shape, seed=training.seed)
            peers_.append(DilocoSync(model, build_optimizer(model, run.optimizer), run))
        numel = sum(p.numel() for p in peers_[0].replica.params)

        def wire(vector: torch.Tensor, sender: str) -> torch.Tensor | None:
            try:
                return codec.decode_contribution(codec.encode_contribution(vector), numel, sender=sender)
            except ProtocolError:  # a reducer leaves out a contribution that does not decode
                return None

        pending: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # overlap: the round in flight
        applied, spread = 0, []
        for window in range(outer_steps):
            honest = []
            for peer, strategy in enumerate(peers_):
                for i in range(inner_steps):
                    seed = derive_seed(tag, f"peer{peer}", window, i)
                    _gradient_step(strategy.replica.model, self.dataset, seed, batch, self.seq_len)
                    strategy.absorb(batch, step=window, mean=True)
                if strategy.overlap:
                    if pending is not None:  # the previous window's round lands now
                        strategy.apply(RoundResult(pending[0], True, sent=pending[1][peer]), window)
                    strategy.close_window(inner_steps * batch)
                honest.append(strategy.contribution(inner_steps * batch))
            truth = torch.stack(honest)
            sent = honest[: peers - attackers]
            weights = [1.0] * len(sent)
            for attack, own in zip(attacks, honest[peers - attackers :], strict=True):
                sent.append(attack.contribution(own, window, peers=truth if attack.omniscient else None))
                weights.append(attack.weight(1.0))
            sent = [wire(vector, f"peer{peer}") for peer, vector in enumerate(sent)]
            kept = [i for i, vector in enumerate(sent) if vector is not None]
            result = aggregate(
                torch.stack([sent[i] for i in kept]),
                torch.tensor([weights[i] for i in kept], dtype=torch.float64),
                seed=window,
            )
            sent = [vector if vector is not None else torch.zeros(numel) for vector in sent]
            spread.append(_spread(truth[: peers - attackers], result))
            result = codec.decode(codec.encode(result), numel, sender="reducer")  # as a reducer encodes it
            if training.outer_overlap:
                applied += pending is not None
                pending = (result, sent)
                continue
            for strategy, carried in zip(peers_, sent, strict=True):
                if strategy.apply(RoundResult(result, True, sent=carried), window):
                    strategy.reset()  # as the trainer does once a round ends the window
            applied += 1
        return validation_loss(peers_[0].synced_model, self.validation), applied, spread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--recipes",
        nargs="+",
        help=f"default: {' '.join(map(repr, DEFAULT_RECIPES))} (--quick: {' '.join(map(repr, QUICK_RECIPES))})",
    )
    parser.add_argument("--samples", type=int, default=11200, help="samples every recipe processes")
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=28, help="samples per peer per (inner) step")
    parser.add_argument("--model-size", default="small", choices=["tiny", "small", "demo"])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny model, a few hundred samples")
    args = parser.parse_args(argv)
    if args.quick:
        args.model_size, args.samples, args.batch = "tiny", 320, 8
        args.recipes = args.recipes or QUICK_RECIPES
    args.recipes = args.recipes or DEFAULT_RECIPES
    torch.set_num_threads(args.threads)
    recipes = [parse_recipe(text, args.batch, args.peers) for text in args.recipes]
    lab = Lab(args)
    rows = []
    for round_index in range(args.repeat):
        for recipe in recipes:  # interleaved: every recipe once per round
            row = lab.run(recipe, round_index)
            rows.append(row)
            spread = ""
            if row["spread"]:
                pairwise, cosine, norm = (
                    sum(w[i] for w in row["spread"]) / len(row["spread"]) for i in range(3)
                )
                spread = (
                    f", honest pairwise cosine {pairwise:.2f}, aggregate cosine {cosine:.2f} norm {norm:.2f}"
                )
            print(f"round {round_index} {row['name']}: val {row['val_loss']:.4f} ({row['steps']} steps{spread}, {row['s']:.0f}s)", flush=True)  # fmt: skip
    print(
        f"\n{args.peers} peers, model {args.model_size}, {args.samples} samples per recipe, "
        f"initial val loss {lab.initial_val_loss:.4f}"
    )
    print("| round | recipe | steps | val loss (vs every_step) |\n|---|---|---|---|")
    for row in rows:
        anchor = next((r for r in rows if r["sync"] == "every_step" and r["round"] == row["round"]), None)
        row["loss_ratio"] = row["val_loss"] / anchor["val_loss"] if anchor else None
        ratio = f" ({row['loss_ratio']:.3f})" if anchor else ""
        print(f"| {row['round']} | {row['name']} | {row['steps']} | {row['val_loss']:.4f}{ratio} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
