//! Schedules: periodic jobs whose ticks become jobs inside the leases and locks of their queue.
//!
//! A schedule is a row of the extension's table `inbox_periodic_jobs`: its queue, name, cron
//! expression, time zone, payload and the next tick it has to fire. Every `inbox_lease` and
//! `inbox_lock` on a queue first calls [`enqueue_due_ticks`], which locks the queue's due
//! schedules with `FOR UPDATE SKIP LOCKED`, enqueues one job per schedule (its key names the
//! schedule and the tick) and stores the schedule's next tick, all in the caller's transaction.
//! Of any number of racing callers only the one holding a schedule's row fires it; the others
//! skip it, and READ COMMITTED re-checks `next_tick` on the latest row version of a schedule just
//! fired, so no tick is fired twice. With no leader and no clock of its own, a tick fires at the
//! first lease after it; nothing is due most of the time, and then the call costs one index probe,
//! or on a queue without schedules nothing (see [`may_have_schedules`]).

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::rc::Rc;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds, Year};
use croner::Cron;
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{self, Oid};
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::datum::{spi_result_datum, Jsonb, RegClass};
use crate::error::*;
use crate::plans::{self, Op, Plan};
use crate::shape::{Payload, QueueShape};
use crate::statements::Sql;

// The table of schedules, in the extension's schema: the DDL the SQL-only build shares.
extension_sql_file!("../../sql/shared/periodic_jobs.sql", name = "periodic_jobs");

// When each schedule last fired, and running one now: the same SQL in both builds. After
// browse.sql, the last of the others: one order, so the generated schema is the same at every
// build.
extension_sql_file!(
    "../../sql/shared/schedule_runs.sql",
    name = "schedule_runs",
    requires = ["browse"]
);

// What only an extension has: `pg_dump` dumps the table's rows, and an event trigger.
extension_sql!(
    r#"
SELECT pg_catalog.pg_extension_config_dump('inbox_periodic_jobs', '');
-- Which queues are paused and their limits are the user's data too.
SELECT pg_catalog.pg_extension_config_dump('inbox_queue_controls', '');
SELECT pg_catalog.pg_extension_config_dump('inbox_queue_slots', '');

-- A dropped queue takes its schedules with it. The policies' privilege checks cannot see a table
-- that is gone, so they let anyone see and remove the schedules of a queue that no longer
-- exists (which say nothing and fire nothing), and this function, which deletes those of
-- the tables the command dropped, runs with the rights of whoever dropped them, like every other
-- function of the extension.
CREATE FUNCTION inbox_drop_schedules_of_dropped_tables() RETURNS event_trigger
LANGUAGE plpgsql SECURITY INVOKER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    DELETE FROM @extschema@.inbox_periodic_jobs
     WHERE queue::oid IN (SELECT objid FROM pg_catalog.pg_event_trigger_dropped_objects()
                           WHERE classid = 'pg_catalog.pg_class'::pg_catalog.regclass
                             AND objsubid = 0);
    DELETE FROM @extschema@.inbox_relays
     WHERE outbox::oid IN (SELECT objid FROM pg_catalog.pg_event_trigger_dropped_objects()
                            WHERE classid = 'pg_catalog.pg_class'::pg_catalog.regclass
                              AND objsubid = 0);
    DELETE FROM @extschema@.inbox_queue_controls
     WHERE queue::oid IN (SELECT objid FROM pg_catalog.pg_event_trigger_dropped_objects()
                           WHERE classid = 'pg_catalog.pg_class'::pg_catalog.regclass
                             AND objsubid = 0);
    DELETE FROM @extschema@.inbox_queue_slots
     WHERE queue::oid IN (SELECT objid FROM pg_catalog.pg_event_trigger_dropped_objects()
                           WHERE classid = 'pg_catalog.pg_class'::pg_catalog.regclass
                             AND objsubid = 0);
END
$$;
REVOKE ALL ON FUNCTION inbox_drop_schedules_of_dropped_tables() FROM PUBLIC;
CREATE EVENT TRIGGER inbox_drop_schedules_of_dropped_tables ON sql_drop
    EXECUTE FUNCTION inbox_drop_schedules_of_dropped_tables();
"#,
    name = "periodic_jobs_extension",
    requires = ["periodic_jobs", "outbox", "controls", "limits"]
);

/// Sends the schedule table's relcache invalidation, which every session receives once the change
/// commits, so that none keeps its copy of the scheduled queues (see [`may_have_schedules`]).
#[pg_trigger(sql = r#"
CREATE FUNCTION inbox_periodic_jobs_changed() RETURNS trigger LANGUAGE c
    SET search_path = pg_catalog, pg_temp
    AS '@MODULE_PATHNAME@', 'inbox_periodic_jobs_changed_wrapper';
"#)]
fn inbox_periodic_jobs_changed<'a>(
    trigger: &'a PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, PgTriggerError> {
    let table = trigger.relation()?.oid();
    // SAFETY: queues an invalidation of a table that exists, in the current transaction.
    unsafe { pg_sys::CacheInvalidateRelcacheByRelid(table) };
    Ok(None)
}

// `ALWAYS`: a subscriber's apply worker (session_replication_role = replica) must tell too.
extension_sql!(
    r#"
CREATE TRIGGER inbox_periodic_jobs_changed AFTER INSERT OR UPDATE OF queue ON inbox_periodic_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION inbox_periodic_jobs_changed();
ALTER TABLE inbox_periodic_jobs ENABLE ALWAYS TRIGGER inbox_periodic_jobs_changed;
"#,
    name = "periodic_jobs_changed",
    requires = ["periodic_jobs", inbox_periodic_jobs_changed]
);

const TABLE: &str = "inbox_periodic_jobs";

/// Most schedules one lease or lock fires: the rest fire at the next one.
const FIRE_BATCH: i64 = 100;

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
const POSTGRES_EPOCH_MICROS: i64 = 946_684_800_000_000;

/// A schedule's cron expression in its time zone.
pub(crate) struct Timetable {
    cron: Cron,
    zone: Tz,
}

impl Timetable {
    /// Parses a cron expression of 5 fields (minute to day of week) or 6 (seconds first), or a
    /// nickname (`@hourly`, ...), and an IANA time zone name.
    pub fn parse(cron: &str, zone: &str) -> Result<Timetable, String> {
        let parser = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build();
        let cron = parser
            .parse(cron)
            .map_err(|e| format!("invalid cron expression \"{cron}\": {e}"))?;
        let zone = Tz::from_str(zone).map_err(|_| format!("unknown time zone \"{zone}\""))?;
        Ok(Timetable { cron, zone })
    }

    /// The first tick strictly after `time`.
    pub fn next_after(&self, time: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
        self.cron
            .find_next_occurrence(&time.with_timezone(&self.zone), false)
            .map(|tick| tick.with_timezone(&Utc))
            .map_err(|e| {
                format!(
                    "cron expression \"{}\" has no tick after {}: {e}",
                    self.cron,
                    time.format("%Y-%m-%dT%H:%M:%SZ")
                )
            })
    }

    /// The tick to fire at `now` for a schedule whose stored next tick `due` has passed, and the
    /// tick after it: the latest tick at or before `now` (ticks missed while no one leased
    /// collapse into that one), never earlier than `due`.
    pub fn fire(
        &self,
        due: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Result<(DateTime<Utc>, DateTime<Utc>), String> {
        let latest = self
            .cron
            .find_previous_occurrence(&now.with_timezone(&self.zone), true)
            .map(|tick| tick.with_timezone(&Utc))
            .unwrap_or(due)
            .max(due);
        Ok((latest, self.next_after(now)?))
    }
}

/// The dedup key of the job of `schedule`'s tick at `tick`.
pub(crate) fn tick_key(schedule: &str, tick: DateTime<Utc>) -> String {
    format!("schedule:{schedule}:{}", tick.format("%Y-%m-%dT%H:%M:%SZ"))
}

pub(crate) fn from_postgres(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(micros.saturating_add(POSTGRES_EPOCH_MICROS))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

pub(crate) fn to_postgres(time: DateTime<Utc>) -> i64 {
    time.timestamp_micros() - POSTGRES_EPOCH_MICROS
}

fn timestamptz(micros: i64) -> DatumWithOid<'static> {
    // SAFETY: a timestamptz is an int64 passed by value.
    unsafe { DatumWithOid::new(pg_sys::Datum::from(micros), pg_sys::TIMESTAMPTZOID) }
}

/// PostgreSQL's `'infinity'` timestamptz: where a schedule that can no longer fire is parked.
const INFINITY: i64 = i64::MAX;

/// The current time, read from the clock (as leases read it).
fn clock_now() -> i64 {
    // SAFETY: GetCurrentTimestamp only reads the clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// The statements of the hook, prepared once per backend against the schedule table.
struct Prepared {
    /// `$1` queue, `$2` now: the queue's due schedules, locked.
    due: Plan,
    /// `$1` queue, `$2` name, `$3` next tick, `$4` the tick that fired (NULL: none).
    advance: Plan,
    /// The queues that have schedules.
    scheduled: Plan,
}

thread_local! {
    static PREPARED: RefCell<Option<Rc<Prepared>>> = const { RefCell::new(None) };
    /// The oid of the schedule table the statements were prepared against.
    static TABLE_OID: Cell<Oid> = const { Cell::new(pg_sys::InvalidOid) };
    /// Set by the relcache callback: the statements are dropped before their next use (never
    /// while one of them may be running).
    static STALE: Cell<bool> = const { Cell::new(false) };
    static CALLBACK: Cell<bool> = const { Cell::new(false) };
    /// The queues with schedules as the user of this oid sees them (row-level security), dropped
    /// with the statements.
    static SCHEDULED: RefCell<Option<(Oid, HashSet<Oid>)>> = const { RefCell::new(None) };
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn relcache_invalidated(_arg: pg_sys::Datum, relid: Oid) {
    if relid == pg_sys::InvalidOid || relid == TABLE_OID.with(Cell::get) {
        STALE.with(|stale| stale.set(true));
    }
}

fn prepared(client: &SpiClient<'_>) -> Rc<Prepared> {
    if !CALLBACK.with(Cell::get) {
        // SAFETY: registered once per backend; the callback lives as long as the library.
        unsafe {
            pg_sys::CacheRegisterRelcacheCallback(
                Some(relcache_invalidated),
                pg_sys::Datum::from(0),
            )
        };
        CALLBACK.with(|registered| registered.set(true));
    }
    if STALE.with(|stale| stale.replace(false)) {
        PREPARED.with(|prepared| prepared.borrow_mut().take());
        SCHEDULED.with(|scheduled| scheduled.borrow_mut().take());
    }
    if let Some(prepared) = PREPARED.with(|prepared| prepared.borrow().clone()) {
        return prepared;
    }
    let (table, oid) = crate::names::extension_table(client, TABLE);
    let prepare = |what: &str, text: String, args: &[Oid]| {
        let args = args.to_vec();
        Plan::prepare(what, Sql { text, args }, 0)
    };
    let prepared = Rc::new(Prepared {
        due: prepare(
            "due schedules",
            format!(
                "SELECT name, cron, time_zone, payload, next_tick FROM {table} \
                  WHERE queue OPERATOR(pg_catalog.=) $1 AND next_tick OPERATOR(pg_catalog.<=) $2 \
                  ORDER BY next_tick LIMIT {FIRE_BATCH} FOR UPDATE SKIP LOCKED"
            ),
            &[pg_sys::REGCLASSOID, pg_sys::TIMESTAMPTZOID],
        ),
        advance: prepare(
            "schedule advance",
            format!(
                "UPDATE {table} SET next_tick = $3, last_tick = COALESCE($4, last_tick) \
                  WHERE queue OPERATOR(pg_catalog.=) $1 AND name OPERATOR(pg_catalog.=) $2"
            ),
            &[
                pg_sys::REGCLASSOID,
                pg_sys::TEXTOID,
                pg_sys::TIMESTAMPTZOID,
                pg_sys::TIMESTAMPTZOID,
            ],
        ),
        scheduled: prepare(
            "scheduled queues",
            format!("SELECT DISTINCT queue::pg_catalog.oid FROM {table}"),
            &[],
        ),
    });
    TABLE_OID.with(|table| table.set(oid));
    PREPARED.with(|cached| *cached.borrow_mut() = Some(prepared.clone()));
    prepared
}

/// Whether `queue` may have schedules; false when the session's copy of the scheduled queues says
/// it has none, so that a lease on a queue without schedules costs no statement here. The copy
/// is read at `READ COMMITTED` (its statement sees every schedule committed before it) and
/// dropped by the table's relcache invalidation, which every change that can add a schedule to a
/// queue sends when it commits (see [`inbox_periodic_jobs_changed`]); an older snapshot
/// (`REPEATABLE READ`) may not see a schedule, so it neither reads nor trusts the copy.
fn may_have_schedules(prepared: &Prepared, queue: Oid) -> bool {
    // SAFETY: reads the transaction's isolation level and the current user.
    let (isolation, user) = unsafe { (pg_sys::XactIsoLevel, pg_sys::GetUserId()) };
    if isolation >= pg_sys::XACT_REPEATABLE_READ as i32 {
        return true;
    }
    let known = SCHEDULED.with(|scheduled| {
        scheduled
            .borrow()
            .as_ref()
            .filter(|(seen_by, _)| *seen_by == user)
            .map(|(_, queues)| queues.contains(&queue))
    });
    if let Some(known) = known {
        return known;
    }
    let rows = prepared.scheduled.read_rows(&[]);
    let queues: HashSet<Oid> = (0..rows.len())
        .filter_map(|row| rows.get::<Oid>(row, 1))
        .collect();
    let has = queues.contains(&queue);
    SCHEDULED.with(|scheduled| *scheduled.borrow_mut() = Some((user, queues)));
    has
}

/// The job of one tick: `$1` payload, `$2` due time (the tick), `$3` key. A tick whose job is
/// still queued inserts nothing.
fn tick_insert(queue: &QueueShape) -> Sql {
    Sql {
        text: format!(
            "INSERT INTO {} (payload, locked_until, key) VALUES ($1, $2, $3) \
             ON CONFLICT (key) WHERE key IS NOT NULL DO NOTHING",
            queue.table
        ),
        args: vec![pg_sys::JSONBOID, pg_sys::TIMESTAMPTZOID, pg_sys::TEXTOID],
    }
}

/// A due schedule, read from its locked row.
struct Due {
    name: String,
    cron: String,
    time_zone: String,
    payload: pg_sys::Datum,
    next_tick: i64,
}

/// Enqueues the due ticks of `queue`'s schedules, in the caller's transaction; called by
/// `inbox_lease` and `inbox_lock` before they take their jobs, so the tick's job can be taken by
/// the same call.
pub(crate) fn enqueue_due_ticks(client: &mut SpiClient<'_>, queue: Oid) {
    let prepared = prepared(client);
    if !may_have_schedules(&prepared, queue) {
        return;
    }
    let now = clock_now();
    let rows = prepared
        .due
        .rows(&[RegClass(queue).into(), timestamptz(now)]);
    if rows.len() == 0 {
        return;
    }
    let due: Vec<Due> = (0..rows.len())
        .map(|n| Due {
            name: rows.get(n, 1).unwrap_or_default(),
            cron: rows.get(n, 2).unwrap_or_default(),
            time_zone: rows.get(n, 3).unwrap_or_default(),
            // SAFETY: the last SPI result is this one, with the payload in column 4 (NOT NULL);
            // the copy lives in the caller's memory context, beyond the next statement.
            payload: unsafe { spi_result_datum(n, 4) }.unwrap_or(pg_sys::Datum::from(0)),
            next_tick: rows
                .get::<TimestampWithTimeZone>(n, 5)
                .map_or(now, |tick| tick.into_inner()),
        })
        .collect();
    let shape = plans::queue(client, queue);
    let insert = plans::queue_plan(client, queue, Op::TickInsert, tick_insert);
    for schedule in due {
        let (next, fired) =
            match Timetable::parse(&schedule.cron, &schedule.time_zone).and_then(|timetable| {
                timetable.fire(from_postgres(schedule.next_tick), from_postgres(now))
            }) {
                Ok((tick, next)) => {
                    // SAFETY: `payload` is a jsonb datum copied out of the schedule's row.
                    let payload = unsafe { DatumWithOid::new(schedule.payload, pg_sys::JSONBOID) };
                    insert.run(&[
                        payload,
                        timestamptz(to_postgres(tick)),
                        tick_key(&schedule.name, tick).as_str().into(),
                    ]);
                    (to_postgres(next), timestamptz(to_postgres(tick)))
                }
                // Only a schedule stored by another version of the cron or time zone rules gets
                // here: it is parked rather than failing every lease of its queue.
                Err(problem) => {
                    pgrx::warning!(
                        "inbox: schedule \"{}\" of queue {} is paused: {problem}",
                        schedule.name,
                        shape.table
                    );
                    (INFINITY, DatumWithOid::null_oid(pg_sys::TIMESTAMPTZOID))
                }
            };
        prepared.advance.run(&[
            RegClass(queue).into(),
            schedule.name.as_str().into(),
            timestamptz(next),
            fired,
        ]);
    }
}

/// Checks that the caller may schedule jobs into `queue`: a `jsonb` queue with a `key` column
/// that has a unique index, and INSERT privilege on it.
fn check_queue(client: &SpiClient<'_>, queue: Oid) {
    let shape = plans::queue(client, queue);
    if shape.payload != Payload::Jsonb {
        raise(
            ERRCODE_DATATYPE_MISMATCH,
            format!(
                "queue {} stores {} payloads; a schedule's payload is jsonb",
                shape.table,
                shape.payload.type_name()
            ),
        );
    }
    if !shape.has_key {
        raise(
            ERRCODE_UNDEFINED_COLUMN,
            format!(
                "queue {} has no column \"key\": a schedule dedups its ticks by key",
                shape.table
            ),
        );
    }
    let may_insert = client
        .select(
            "SELECT pg_catalog.has_table_privilege($1, 'INSERT')",
            None,
            &[RegClass(queue).into()],
        )
        .and_then(|rows| rows.first().get_one::<bool>())
        .unwrap_or_else(|e| internal(e));
    if may_insert != Some(true) {
        raise(
            ERRCODE_INSUFFICIENT_PRIVILEGE,
            format!(
                "permission denied for table {}: a schedule enqueues jobs, which needs INSERT",
                shape.table
            ),
        );
    }
    // The tick's insert skips a key already queued: `ON CONFLICT (key) WHERE key IS NOT NULL`
    // needs a unique index on `key` alone (partial on `key IS NOT NULL`, or not partial).
    let unique_key = client
        .select(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_index i \
                              JOIN pg_catalog.pg_attribute a \
                                ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
                             WHERE i.indrelid = $1 AND i.indisunique AND i.indisvalid \
                               AND i.indimmediate AND i.indnkeyatts = 1 AND a.attname = 'key' \
                               AND i.indexprs IS NULL \
                               AND (i.indpred IS NULL \
                                    OR pg_catalog.pg_get_expr(i.indpred, i.indrelid) \
                                       = '(key IS NOT NULL)'))",
            None,
            &[RegClass(queue).into()],
        )
        .and_then(|rows| rows.first().get_one::<bool>())
        .unwrap_or_else(|e| internal(e));
    if unique_key != Some(true) {
        raise(
            ERRCODE_INVALID_COLUMN_REFERENCE,
            format!(
                "column \"key\" of queue {} has no unique index: a schedule dedups its ticks by key",
                shape.table
            ),
        );
    }
}

/// Creates or replaces the schedule `name` of `queue`: a job with `payload` at every tick of
/// `cron` in `time_zone`.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn inbox_schedule(
    queue: Option<RegClass>,
    name: Option<&str>,
    cron: Option<&str>,
    payload: default!(Option<Jsonb>, "'{}'"),
    time_zone: default!(Option<&str>, "'UTC'"),
) {
    let queue = required(queue, "queue").0;
    let name = required(name, "name");
    let cron = required(cron, "cron");
    let payload = required(payload, "payload");
    let time_zone = required(time_zone, "time_zone");
    if name.is_empty() {
        raise(ERRCODE_INVALID_PARAMETER_VALUE, "name must not be empty");
    }
    let timetable = Timetable::parse(cron, time_zone)
        .unwrap_or_else(|problem| raise(ERRCODE_INVALID_PARAMETER_VALUE, problem));
    let next = timetable
        .next_after(from_postgres(clock_now()))
        .unwrap_or_else(|problem| raise(ERRCODE_INVALID_PARAMETER_VALUE, problem));
    Spi::connect_mut(|client| {
        check_queue(client, queue);
        let (table, _) = crate::names::extension_table(client, TABLE);
        // Declaring the same schedule again (a service does it at every start) keeps its next
        // tick, so that a tick due while the service was down still fires.
        client
            .update(
                format!(
                    "INSERT INTO {table} AS s (queue, name, cron, time_zone, payload, next_tick) \
                     VALUES ($1, $2, $3, $4, $5, $6) \
                     ON CONFLICT (queue, name) DO UPDATE \
                        SET next_tick = CASE WHEN s.cron = excluded.cron \
                                              AND s.time_zone = excluded.time_zone \
                                             THEN s.next_tick ELSE excluded.next_tick END, \
                            cron = excluded.cron, time_zone = excluded.time_zone, \
                            payload = excluded.payload"
                )
                .as_str(),
                None,
                &[
                    RegClass(queue).into(),
                    name.into(),
                    cron.into(),
                    time_zone.into(),
                    payload.into(),
                    timestamptz(to_postgres(next)),
                ],
            )
            .unwrap_or_else(|e| internal(e));
    });
}

/// Removes the schedule `name` of `queue`; true when it existed. Jobs it enqueued stay queued.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn inbox_unschedule(queue: Option<RegClass>, name: Option<&str>) -> bool {
    let queue = required(queue, "queue").0;
    let name = required(name, "name");
    Spi::connect_mut(|client| {
        let (table, _) = crate::names::extension_table(client, TABLE);
        client
            .update(
                format!("DELETE FROM {table} WHERE queue = $1 AND name = $2").as_str(),
                None,
                &[RegClass(queue).into(), name.into()],
            )
            .unwrap_or_else(|e| internal(e))
            .len()
            == 1
    })
}

/// The schedules of `queue`, by name, with the next tick each will fire and the last it fired.
#[pg_extern(stable, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
#[allow(clippy::type_complexity)]
fn inbox_schedules(
    queue: Option<RegClass>,
) -> TableIterator<
    'static,
    (
        name!(name, String),
        name!(cron, String),
        name!(time_zone, String),
        name!(payload, Option<Jsonb>),
        name!(next_tick, TimestampWithTimeZone),
        name!(last_tick, Option<TimestampWithTimeZone>),
    ),
> {
    let queue = required(queue, "queue").0;
    let rows = Spi::connect(|client| {
        let (table, _) = crate::names::extension_table(client, TABLE);
        let rows = client
            .select(
                format!(
                    "SELECT name, cron, time_zone, payload, next_tick, last_tick FROM {table} \
                      WHERE queue = $1 ORDER BY name"
                )
                .as_str(),
                None,
                &[RegClass(queue).into()],
            )
            .unwrap_or_else(|e| internal(e));
        rows.enumerate()
            .map(|(n, row)| {
                (
                    row.get::<String>(1).ok().flatten().unwrap_or_default(),
                    row.get::<String>(2).ok().flatten().unwrap_or_default(),
                    row.get::<String>(3).ok().flatten().unwrap_or_default(),
                    // SAFETY: the last SPI result is this one, with the payload in column 4.
                    unsafe { spi_result_datum(n, 4) }.map(Jsonb),
                    row.get::<TimestampWithTimeZone>(5)
                        .ok()
                        .flatten()
                        .unwrap_or_else(TimestampWithTimeZone::positive_infinity),
                    row.get::<TimestampWithTimeZone>(6).ok().flatten(),
                )
            })
            .collect::<Vec<_>>()
    });
    TableIterator::new(rows)
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use chrono::{DateTime, Utc};
    use pgrx::prelude::*;

    use super::{tick_key, Timetable};

    fn at(time: &str) -> DateTime<Utc> {
        time.parse().expect("an RFC 3339 time")
    }

    fn ticks(cron: &str, zone: &str, from: &str, count: usize) -> Vec<DateTime<Utc>> {
        let timetable = Timetable::parse(cron, zone).expect("a valid schedule");
        let mut time = at(from);
        (0..count)
            .map(|_| {
                time = timetable.next_after(time).expect("a next tick");
                time
            })
            .collect()
    }

    #[pg_test]
    fn five_fields_are_minutes_and_six_start_with_seconds() {
        assert_eq!(
            ticks("*/20 * * * *", "UTC", "2026-02-01T00:00:00Z", 2),
            [at("2026-02-01T00:20:00Z"), at("2026-02-01T00:40:00Z")]
        );
        assert_eq!(
            ticks("*/20 * * * * *", "UTC", "2026-02-01T00:00:00.5Z", 2),
            [at("2026-02-01T00:00:20Z"), at("2026-02-01T00:00:40Z")]
        );
        assert!(Timetable::parse("* * * *", "UTC").is_err());
        assert!(Timetable::parse("0 0 1 1 * * 2030", "UTC").is_err());
        assert!(Timetable::parse("* * * * *", "utc").is_err());
    }

    /// Either restricted day field matches, as in Vixie cron: Fridays and the 13th.
    #[pg_test]
    fn restricted_day_of_month_and_day_of_week_each_match() {
        assert_eq!(
            ticks("0 0 13 * 5", "UTC", "2026-01-01T00:00:00Z", 3),
            [
                at("2026-01-02T00:00:00Z"),
                at("2026-01-09T00:00:00Z"),
                at("2026-01-13T00:00:00Z")
            ]
        );
    }

    /// 02:30 does not exist in Berlin on 2026-03-29 (02:00 becomes 03:00): that day's tick is
    /// at 03:00 local, once.
    #[pg_test]
    fn a_tick_in_the_spring_gap_fires_once_after_it() {
        assert_eq!(
            ticks("30 2 * * *", "Europe/Berlin", "2026-03-28T12:00:00Z", 3),
            [
                at("2026-03-29T01:00:00Z"),
                at("2026-03-30T00:30:00Z"),
                at("2026-03-31T00:30:00Z")
            ]
        );
    }

    /// 02:30 happens twice in Berlin on 2026-10-25 (03:00 becomes 02:00): it fires once, at the
    /// first; after it, the next tick is the next day's.
    #[pg_test]
    fn a_tick_repeated_in_the_autumn_fires_once() {
        assert_eq!(
            ticks("30 2 * * *", "Europe/Berlin", "2026-10-24T12:00:00Z", 2),
            [at("2026-10-25T00:30:00Z"), at("2026-10-26T01:30:00Z")]
        );
        let timetable = Timetable::parse("30 2 * * *", "Europe/Berlin").unwrap();
        // Fired late, after the repeated 02:30 too: one tick, then the next day's.
        let (_, next) = timetable
            .fire(at("2026-10-25T00:30:00Z"), at("2026-10-25T01:40:00Z"))
            .unwrap();
        assert_eq!(next, at("2026-10-26T01:30:00Z"));
    }

    #[pg_test]
    fn a_zone_keeps_its_local_time_across_dst() {
        assert_eq!(
            ticks("0 9 * * *", "America/New_York", "2026-03-07T20:00:00Z", 2),
            [at("2026-03-08T13:00:00Z"), at("2026-03-09T13:00:00Z")]
        );
        assert_eq!(
            ticks("0 9 * * *", "America/New_York", "2026-01-07T20:00:00Z", 1),
            [at("2026-01-08T14:00:00Z")]
        );
    }

    /// Missed ticks collapse into the latest at the firing; the next tick is after the firing.
    #[pg_test]
    fn missed_ticks_fire_as_the_latest_only() {
        let every_second = Timetable::parse("* * * * * *", "UTC").unwrap();
        assert_eq!(
            every_second
                .fire(at("2026-02-01T00:00:01Z"), at("2026-02-01T00:00:03.5Z"))
                .unwrap(),
            (at("2026-02-01T00:00:03Z"), at("2026-02-01T00:00:04Z"))
        );
        let weekly = Timetable::parse("0 3 * * 0", "UTC").unwrap();
        assert_eq!(
            weekly
                .fire(at("2026-11-01T03:00:00Z"), at("2026-11-30T12:00:00Z"))
                .unwrap(),
            (at("2026-11-29T03:00:00Z"), at("2026-12-06T03:00:00Z"))
        );
        // On time: the due tick itself.
        assert_eq!(
            weekly
                .fire(at("2026-11-29T03:00:00Z"), at("2026-11-29T03:00:00.2Z"))
                .unwrap(),
            (at("2026-11-29T03:00:00Z"), at("2026-12-06T03:00:00Z"))
        );
    }

    #[pg_test]
    fn a_tick_key_names_the_schedule_and_the_tick_in_utc() {
        assert_eq!(
            tick_key("nightly", at("2026-12-01T03:00:00+01:00")),
            "schedule:nightly:2026-12-01T02:00:00Z"
        );
    }
}
