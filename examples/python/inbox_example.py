"""The inbox extension from Python with psycopg 3, through its SQL API only.

A producer enqueues refund jobs; workers lease them, write the refund in the same transaction as
the job's ack (so a refund is written exactly once, however often the job runs), retry a failed
job with its error, and leave it dead-lettered after MAX_ATTEMPTS; a webhook consumer claims each
event in the dedup ledger in the same transaction as its effect.

    DATABASE_URL=postgres://... python inbox_example.py   # sets up, runs, prints the outcome

What is exactly once: rows written in this database in the transaction that acks the job (or
that claims the event). A call to anything outside it (HTTP, e-mail, a card processor) is at
least once: a retry after the call succeeded makes it again, so send it an idempotency key.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import psycopg
from psycopg.types.json import Jsonb

QUEUE = "refund_jobs"
LEDGER = "webhook_inbox"
MAX_ATTEMPTS = 3


def setup(conn: psycopg.Connection) -> None:
    """Creates the queue, the ledger and the effect tables (each call is idempotent)."""
    with conn.transaction():
        conn.execute("SELECT inbox_create_queue(%s)", (QUEUE,))
        conn.execute("SELECT inbox_create_ledger(%s)", (LEDGER,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS refunds (order_id bigint NOT NULL, amount_cents int NOT NULL)"
        )
        conn.execute(
            "CREATE TABLE IF NOT EXISTS payments (event_id text NOT NULL, amount_cents int NOT NULL)"
        )


# --- the producer -------------------------------------------------------------------------------


def enqueue_refund(conn: psycopg.Connection, order: int, amount_cents: int, **extra) -> int | None:
    """Enqueues one refund, deduplicated by order while it is queued; returns its id or None."""
    payload = {"order": order, "amount_cents": amount_cents, **extra}
    row = conn.execute(
        "SELECT inbox_enqueue(%s, %s, key => %s)", (QUEUE, Jsonb(payload), f"refund-{order}")
    ).fetchone()
    return row[0]


def enqueue_refunds(conn: psycopg.Connection, payloads: list[dict]) -> int:
    """Enqueues many refunds in one statement; returns how many."""
    rows = conn.execute(
        "SELECT inbox_enqueue_batch(%s, %s)", (QUEUE, [Jsonb(p) for p in payloads])
    ).fetchall()
    return len(rows)


# --- the worker ---------------------------------------------------------------------------------


class Fenced(Exception):
    """The job was taken by another worker since this delivery leased it: roll back."""


@dataclass
class Tally:
    acked: int = 0
    retried: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)


def refund(conn: psycopg.Connection, job: dict, attempt: int) -> None:
    """The handler: writes the refund through the delivery's transaction.

    A job may ask to fail (`fail_attempts`): it writes its refund first and then raises, so the
    rollback of the failed attempt is what keeps the refund from being written twice.
    """
    conn.execute(
        "INSERT INTO refunds (order_id, amount_cents) VALUES (%s, %s)",
        (job["order"], job["amount_cents"]),
    )
    if attempt <= job.get("fail_attempts", 0):
        raise RuntimeError(f"card processor timeout on attempt {attempt}")


def work_until_idle(url: str, handler=refund, lease: str = "30 seconds", batch: int = 10) -> Tally:
    """Leases jobs until the queue has none ready, running each in its own transaction."""
    tally = Tally()
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            # The lease commits on its own (autocommit): the attempt stays counted even if this
            # process dies, so a job that crashes its worker ends up dead-lettered.
            jobs = conn.execute(
                "SELECT id, token, attempt, payload FROM inbox_lease(%s, %s, %s)",
                (QUEUE, batch, lease),
            ).fetchall()
            if not jobs:
                return tally
            for job_id, token, attempt, payload in jobs:
                deliver(conn, handler, job_id, token, attempt, payload, tally)


def deliver(conn, handler, job_id, token, attempt, payload, tally: Tally) -> None:
    """Runs one delivery: the handler's writes and the ack commit together, or not at all."""
    try:
        with conn.transaction():
            handler(conn, payload, attempt)
            (acked,) = conn.execute(
                "SELECT inbox_ack(%s, %s, %s)", (QUEUE, job_id, token)
            ).fetchone()
            if not acked:
                raise Fenced()
        tally.acked += 1
    except Fenced:
        tally.lost += 1  # rolled back: the delivery that holds the job now will do it
    except Exception as error:  # the handler failed: its writes are rolled back
        tally.errors.append(str(error))
        # Retries after a short delay; dead-letters once the job has had MAX_ATTEMPTS.
        conn.execute(
            "SELECT inbox_retry(%s, %s, %s, %s, %s, %s)",
            (QUEUE, job_id, token, timedelta(0), str(error), MAX_ATTEMPTS),
        )
        tally.retried += 1


# --- the dedup ledger ---------------------------------------------------------------------------


def handle_webhook(url: str, event_id: str, amount_cents: int) -> bool:
    """Records a payment once per event, however often the event is delivered.

    The claim and the effect are one transaction: a replay (or a concurrent duplicate) finds
    the key claimed and writes nothing; a crash before the commit leaves neither.
    """
    with psycopg.connect(url) as conn:
        with conn.transaction():
            (first,) = conn.execute("SELECT inbox_claim(%s, %s)", (LEDGER, event_id)).fetchone()
            if first:
                conn.execute(
                    "INSERT INTO payments (event_id, amount_cents) VALUES (%s, %s)",
                    (event_id, amount_cents),
                )
        return first


def main() -> int:
    url = os.environ.get("DATABASE_URL")
    if not url:
        print("set DATABASE_URL", file=sys.stderr)
        return 2
    with psycopg.connect(url, autocommit=True) as conn:
        setup(conn)
        enqueue_refunds(conn, [{"order": n, "amount_cents": 100 + n} for n in range(1, 101)])
        enqueue_refund(conn, 1000, 5, fail_attempts=1)
        enqueue_refund(conn, 1001, 5, fail_attempts=MAX_ATTEMPTS)
    tallies: list[Tally] = []
    workers = [
        threading.Thread(target=lambda: tallies.append(work_until_idle(url))) for _ in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for event in ["evt_1", "evt_2", "evt_1", "evt_2", "evt_1"]:
        handle_webhook(url, event, 42)
    with psycopg.connect(url) as conn:
        refunds = conn.execute("SELECT count(*) FROM refunds").fetchone()[0]
        dead = conn.execute("SELECT dead FROM inbox_stats(%s)", (QUEUE,)).fetchone()[0]
        payments = conn.execute("SELECT count(*) FROM payments").fetchone()[0]
    print(f"refunds written: {refunds}, dead-lettered jobs: {dead}, payments recorded: {payments}")
    print(f"acked {sum(t.acked for t in tallies)}, retried {sum(t.retried for t in tallies)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
