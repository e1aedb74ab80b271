"""The Python example against a real database: effects exactly once, counted in the database.

Each test works in a schema of its own in the database named by DATABASE_URL (where
`CREATE EXTENSION inbox` was run), dropped afterwards.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import inbox_example as ex


@pytest.fixture
def url(monkeypatch):
    base = os.environ["DATABASE_URL"]
    schema = f"py_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base, autocommit=True) as admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
    url = make_conninfo(base, options=f"-c search_path={schema},public")
    # Qualified, so that tables of these names elsewhere on the search_path are never used.
    monkeypatch.setattr(ex, "QUEUE", f"{schema}.refund_jobs")
    monkeypatch.setattr(ex, "LEDGER", f"{schema}.webhook_inbox")
    with psycopg.connect(url, autocommit=True) as conn:
        ex.setup(conn)
    yield url
    with psycopg.connect(base, autocommit=True) as admin:
        admin.execute(f'DROP SCHEMA "{schema}" CASCADE')


def scalar(url: str, sql: str, params=()):
    with psycopg.connect(url) as conn:
        return conn.execute(sql, params).fetchone()[0]


def run_workers(url: str, count: int) -> list[ex.Tally]:
    tallies: list[ex.Tally] = []
    lock = threading.Lock()

    def run():
        tally = ex.work_until_idle(url)
        with lock:
            tallies.append(tally)

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(tallies) == count, "a worker thread failed"
    return tallies


def test_concurrent_workers_write_every_refund_exactly_once(url):
    with psycopg.connect(url, autocommit=True) as conn:
        assert ex.enqueue_refunds(conn, [{"order": n, "amount_cents": n} for n in range(300)]) == 300
        for n in range(1000, 1010):
            ex.enqueue_refund(conn, n, 1, fail_attempts=1)  # fails once, then succeeds
        for n in range(2000, 2003):
            ex.enqueue_refund(conn, n, 1, fail_attempts=ex.MAX_ATTEMPTS)  # always fails

    tallies = run_workers(url, 4)

    assert sum(t.acked for t in tallies) == 310
    assert sum(t.retried for t in tallies) == 10 + 3 * ex.MAX_ATTEMPTS
    assert scalar(url, "SELECT count(*) FROM refunds") == 310
    assert scalar(url, "SELECT count(DISTINCT order_id) FROM refunds") == 310
    # The failed attempts wrote a refund before raising; their rollback took it back.
    assert scalar(url, "SELECT count(*) FROM refunds WHERE order_id >= 2000") == 0
    with psycopg.connect(url) as conn:
        ready, delayed, leased, dead = conn.execute(
            "SELECT ready, delayed, leased, dead FROM inbox_stats(%s)", (ex.QUEUE,)
        ).fetchone()
        assert (ready, delayed, leased, dead) == (0, 0, 0, 3)
        rows = conn.execute(
            f"SELECT attempt, last_error FROM {ex.QUEUE} ORDER BY id"
        ).fetchall()
    assert [attempt for attempt, _ in rows] == [ex.MAX_ATTEMPTS] * 3
    assert all(f"attempt {ex.MAX_ATTEMPTS}" in error for _, error in rows)


def test_a_queued_key_is_enqueued_once(url):
    with psycopg.connect(url, autocommit=True) as conn:
        first = ex.enqueue_refund(conn, 7, 70)
        again = ex.enqueue_refund(conn, 7, 70)
    assert first is not None and again is None
    assert scalar(url, f"SELECT count(*) FROM {ex.QUEUE}") == 1


def test_a_delivery_that_lost_its_lease_commits_nothing(url):
    with psycopg.connect(url, autocommit=True) as conn:
        ex.enqueue_refund(conn, 42, 4200)
        job_id, token, attempt, payload = conn.execute(
            "SELECT id, token, attempt, payload FROM inbox_lease(%s, 1, '200 milliseconds')",
            (ex.QUEUE,),
        ).fetchone()
        time.sleep(0.5)  # this delivery stalls past its lease; another worker takes the job
        [other] = run_workers(url, 1)
        assert other.acked == 1
        late = ex.Tally()
        ex.deliver(conn, ex.refund, job_id, token, attempt, payload, late)
    assert (late.acked, late.lost) == (0, 1)
    assert scalar(url, "SELECT count(*) FROM refunds WHERE order_id = 42") == 1
    assert scalar(url, f"SELECT count(*) FROM {ex.QUEUE}") == 0


def test_duplicate_webhooks_record_each_payment_once(url):
    events = [f"evt_{n}" for n in range(60)]
    results: list[bool] = []
    lock = threading.Lock()

    def deliver_all():
        for event in events:
            first = ex.handle_webhook(url, event, 42)
            with lock:
                results.append(first)

    threads = [threading.Thread(target=deliver_all) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 * len(events)
    assert results.count(True) == len(events)
    assert scalar(url, "SELECT count(*) FROM payments") == len(events)
    assert scalar(url, "SELECT count(DISTINCT event_id) FROM payments") == len(events)
    assert scalar(url, f"SELECT count(*) FROM {ex.LEDGER}") == len(events)
