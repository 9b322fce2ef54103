"""The ledger's three accountants round by round over a whole schedule (prints JSON).

    .venv/bin/python benchmarks/ledger_check.py [--rounds 2000] [--restart-every 20 1]

For each schedule: ε at the end by the exact μ-GDP closed form, by dp-accounting's PLD composed one
round at a time (as a run does) and by its RDP accountant; the largest per-round relative gap
between PLD and the closed form; and the seconds the incremental PLD took per round.
"""

from __future__ import annotations

import argparse
import json
import time

from diff2_flwr.core.privacy import GaussianEvent, PrivacyLedger, calibrate


def check(rounds: int, restart_every: int, epsilon: float, delta: float) -> dict:
    """ε at the end of one calibrated schedule by the closed form, PLD (composed round by round) and
    RDP; PLD's largest relative gap to the closed form, its round, and PLD's seconds per round."""
    cal = calibrate(epsilon=epsilon, delta=delta, rounds=rounds, restart_every=restart_every,
                    u=1.25, n_min=1651, clients=10)
    ledger, worst, started = PrivacyLedger(delta), (0.0, 0), time.perf_counter()
    for r in range(1, rounds + 1):
        restart = (r - 1) % restart_every == 0
        ledger = ledger.record(GaussianEvent(cal.z1 if restart else cal.z2,
                                             "restart" if restart else "difference"))
        exact, pld = ledger.epsilon, ledger.epsilon_pld
        gap = abs(pld - exact) / exact if exact > 0 else (0.0 if pld == 0 else float("inf"))
        worst = max(worst, (gap, r))
    return {"rounds": rounds, "restart_every": restart_every, "epsilon_exact": ledger.epsilon,
            "epsilon_pld": ledger.epsilon_pld, "epsilon_rdp": ledger.epsilon_rdp,
            "largest_relative_gap": worst[0], "at_round": worst[1],
            "pld_seconds_per_round": (time.perf_counter() - started) / rounds}


def main() -> None:
    """Print :func:`check` of each ``--restart-every`` schedule as a JSON list."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--restart-every", type=int, nargs="+", default=[20, 1])
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    args = parser.parse_args()
    print(json.dumps([check(args.rounds, t, args.epsilon, args.delta) for t in args.restart_every],
                     indent=2))


if __name__ == "__main__":
    main()
