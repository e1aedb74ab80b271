//! Cron conformance, through the public API only, so that it holds for every build of `inbox`:
//! each schedule's next tick (as `inbox_schedules` reports it after `inbox_schedule`) and the
//! tick a lease fires are compared with a reference written here from the rules' definitions
//! (scanning time second by second or minute by minute in the schedule's zone, with chrono-tz):
//! the cases of schedule.rs's unit tests, moved to the next DST changes after today, and a few
//! hundred generated expressions (lists, ranges, steps, names, `L`, `LW`, `W`, `#`, `?`, `+`,
//! nicknames) in several zones.
//!
//! The next tick is counted from the server's clock during the call, which the test brackets
//! between two readings: it must be the reference's tick after one of them.

use std::collections::BTreeSet;

use chrono::{DateTime, Datelike, Duration, NaiveDate, NaiveDateTime, TimeZone, Timelike, Utc};
use chrono_tz::Tz;
use inbox_tests::TestDb;
use tokio_postgres::Client;

/// A day of month field item.
#[derive(Clone, Debug)]
enum DayItem {
    Days(BTreeSet<u32>),
    Last,
    LastWeekday,
    Closest(u32),
}

/// A day of week field item (0 is Sunday).
#[derive(Clone, Debug)]
enum WeekdayItem {
    Every(BTreeSet<u32>),
    Nth(BTreeSet<u32>, u32),
    Last(BTreeSet<u32>),
}

/// An expression's meaning, written independently of its text.
#[derive(Clone, Debug)]
struct Meaning {
    seconds: BTreeSet<u32>,
    minutes: BTreeSet<u32>,
    hours: BTreeSet<u32>,
    months: BTreeSet<u32>,
    days: Vec<DayItem>,
    weekdays: Vec<WeekdayItem>,
    star_days: bool,
    star_weekdays: bool,
    both_days: bool,
    /// One second, one minute and one hour, none from `*` or a step: such a schedule fires
    /// once when its time is repeated or skipped by a DST change.
    fixed: bool,
}

fn days_in_month(year: i32, month: u32) -> u32 {
    let next = if month == 12 {
        NaiveDate::from_ymd_opt(year + 1, 1, 1)
    } else {
        NaiveDate::from_ymd_opt(year, month + 1, 1)
    };
    next.unwrap().pred_opt().unwrap().day()
}

impl Meaning {
    fn day_matches(&self, date: NaiveDate) -> bool {
        if !self.months.contains(&date.month()) {
            return false;
        }
        let length = days_in_month(date.year(), date.month());
        let weekday_of = |day: u32| {
            NaiveDate::from_ymd_opt(date.year(), date.month(), day)
                .unwrap()
                .weekday()
                .num_days_from_sunday()
        };
        let day = date.day();
        let by_day = self.days.iter().any(|item| match item {
            DayItem::Days(days) => days.contains(&day),
            DayItem::Last => day == length,
            DayItem::LastWeekday => {
                let last_weekday = match weekday_of(length) {
                    6 => length - 1,
                    0 => length - 2,
                    _ => length,
                };
                day == last_weekday
            }
            DayItem::Closest(target) => {
                *target <= length
                    && day
                        == match weekday_of(*target) {
                            6 if *target > 1 => target - 1,
                            6 => target + 2,
                            0 if *target < length => target + 1,
                            0 => target - 2,
                            _ => *target,
                        }
            }
        });
        let weekday = weekday_of(day);
        let by_weekday = self.weekdays.iter().any(|item| match item {
            WeekdayItem::Every(days) => days.contains(&weekday),
            WeekdayItem::Nth(days, nth) => days.contains(&weekday) && (day - 1) / 7 + 1 == *nth,
            WeekdayItem::Last(days) => days.contains(&weekday) && day + 7 > length,
        });
        match (self.star_days, self.star_weekdays) {
            (true, true) => true,
            (false, true) => by_day,
            (true, false) => by_weekday,
            (false, false) if self.both_days => by_day && by_weekday,
            (false, false) => by_day || by_weekday,
        }
    }

    fn wall_matches(&self, wall: NaiveDateTime) -> bool {
        self.seconds.contains(&wall.second())
            && self.minutes.contains(&wall.minute())
            && self.hours.contains(&wall.hour())
            && self.day_matches(wall.date())
    }

    /// Whether the schedule fires at `instant`: its local time matches (a fixed schedule only on
    /// the first pass of a repeated hour), or it is the first instant after a gap that swallowed
    /// a fixed schedule's time on a day the schedule runs.
    fn fires_at(&self, zone: Tz, instant: DateTime<Utc>) -> bool {
        let wall = instant.with_timezone(&zone).naive_local();
        if self.wall_matches(wall) {
            if !self.fixed {
                return true;
            }
            let first = zone.from_local_datetime(&wall).earliest().unwrap();
            return first == instant;
        }
        if self.fixed {
            let before = (instant - Duration::seconds(1))
                .with_timezone(&zone)
                .naive_local();
            if wall - before > Duration::seconds(1) && self.day_matches(wall.date()) {
                let mut skipped = before + Duration::seconds(1);
                while skipped < wall {
                    if self.wall_matches(skipped) {
                        return true;
                    }
                    skipped += Duration::seconds(1);
                }
            }
        }
        false
    }

    /// The unit the scan steps by: every tick falls on one.
    fn step(&self) -> Duration {
        if self.seconds.iter().eq([0].iter()) {
            Duration::minutes(1)
        } else {
            Duration::seconds(1)
        }
    }

    /// The first tick strictly after `after` within `window`, by brute force.
    fn next_after(
        &self,
        zone: Tz,
        after: DateTime<Utc>,
        window: Duration,
    ) -> Option<DateTime<Utc>> {
        let step = self.step();
        let mut instant = truncate(after, step) + step;
        let end = after + window;
        while instant <= end {
            if self.fires_at(zone, instant) {
                return Some(instant);
            }
            instant += step;
        }
        None
    }

    /// The last tick at or before `at`, not before `floor`, by brute force.
    fn latest_at(
        &self,
        zone: Tz,
        at: DateTime<Utc>,
        floor: DateTime<Utc>,
    ) -> Option<DateTime<Utc>> {
        let step = self.step();
        let mut instant = truncate(at, step);
        while instant >= floor {
            if self.fires_at(zone, instant) {
                return Some(instant);
            }
            instant -= step;
        }
        None
    }
}

fn truncate(time: DateTime<Utc>, step: Duration) -> DateTime<Utc> {
    let step = step.num_seconds();
    Utc.timestamp_opt(time.timestamp().div_euclid(step) * step, 0)
        .unwrap()
}

fn all(lo: u32, hi: u32) -> BTreeSet<u32> {
    (lo..=hi).collect()
}

const MONTHS: [&str; 12] = [
    "JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC",
];
const WEEKDAYS: [&str; 7] = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"];

/// A random field of plain values in `lo..=hi`: `*`, `*/n`, `a-b`, `a-b/n`, or a list of
/// numbers and ranges; `names` spells some values by name. Returns the text, the values, and
/// whether it is a single value neither from `*` nor a step.
fn plain_field(
    rng: &mut fastrand::Rng,
    lo: u32,
    hi: u32,
    names: Option<(&[&str], u32)>,
) -> (String, BTreeSet<u32>, bool) {
    let spell = |rng: &mut fastrand::Rng, value: u32| match names {
        Some((names, first)) if rng.u8(..3) == 0 => names[(value - first) as usize].to_owned(),
        _ => value.to_string(),
    };
    match rng.u8(..10) {
        0 => ("*".to_owned(), all(lo, hi), false),
        1 => {
            let step = rng.u32(2..=(hi - lo).max(2));
            (
                format!("*/{step}"),
                (lo..=hi).step_by(step as usize).collect(),
                false,
            )
        }
        2 => {
            let a = rng.u32(lo..=hi);
            let b = rng.u32(a..=hi);
            let step = rng.u32(1..=4);
            (
                format!("{a}-{b}/{step}"),
                (a..=b).step_by(step as usize).collect(),
                step == 1 && a == b,
            )
        }
        3..=5 => {
            let value = rng.u32(lo..=hi);
            (spell(rng, value), BTreeSet::from([value]), true)
        }
        _ => {
            let mut values = BTreeSet::new();
            let mut parts = Vec::new();
            for _ in 0..rng.usize(1..=3) {
                if rng.bool() {
                    let a = rng.u32(lo..=hi);
                    let b = rng.u32(a..=hi.min(a + 5));
                    parts.push(format!("{}-{}", spell(rng, a), spell(rng, b)));
                    values.extend(a..=b);
                } else {
                    let value = rng.u32(lo..=hi);
                    parts.push(spell(rng, value));
                    values.insert(value);
                }
            }
            let single = values.len() == 1;
            (parts.join(","), values, single)
        }
    }
}

/// A random expression of five fields (or six, with seconds) and its meaning.
fn generate(rng: &mut fastrand::Rng) -> (String, Meaning) {
    let with_seconds = rng.u8(..8) == 0;
    let (seconds_text, seconds, seconds_fixed) = if with_seconds {
        plain_field(rng, 0, 59, None)
    } else {
        (String::new(), BTreeSet::from([0]), true)
    };
    let (minutes_text, minutes, minutes_fixed) = plain_field(rng, 0, 59, None);
    let (hours_text, hours, hours_fixed) = plain_field(rng, 0, 23, None);
    let (months_text, months) = if rng.u8(..3) == 0 {
        let (text, values, _) = plain_field(rng, 1, 12, Some((&MONTHS, 1)));
        (text, values)
    } else {
        ("*".to_owned(), all(1, 12))
    };
    // Day of month: `*` or `?`, or items.
    let (days_text, days, star_days) = match rng.u8(..6) {
        0 | 1 => (
            if rng.bool() { "*" } else { "?" }.to_owned(),
            vec![DayItem::Days(all(1, 31))],
            true,
        ),
        _ => {
            let mut texts = Vec::new();
            let mut items = Vec::new();
            for _ in 0..rng.usize(1..=2) {
                match rng.u8(..6) {
                    0 => {
                        texts.push("L".to_owned());
                        items.push(DayItem::Last);
                    }
                    1 => {
                        texts.push("LW".to_owned());
                        items.push(DayItem::LastWeekday);
                    }
                    2 => {
                        let day = rng.u32(1..=31);
                        texts.push(format!("{day}W"));
                        items.push(DayItem::Closest(day));
                    }
                    _ => {
                        let (text, values, _) = plain_field(rng, 1, 31, None);
                        if text == "*" {
                            continue;
                        }
                        texts.push(text);
                        items.push(DayItem::Days(values));
                    }
                }
            }
            if texts.is_empty() {
                texts.push("15".to_owned());
                items.push(DayItem::Days(BTreeSet::from([15])));
            }
            (texts.join(","), items, false)
        }
    };
    // `LW` and `L` together read as `LW` alone.
    let days = if days.iter().any(|d| matches!(d, DayItem::LastWeekday)) {
        days.into_iter()
            .filter(|d| !matches!(d, DayItem::Last))
            .collect()
    } else {
        days
    };
    let (weekdays_text, weekdays, star_weekdays) = match rng.u8(..5) {
        0 | 1 => (
            if rng.bool() { "*" } else { "?" }.to_owned(),
            vec![WeekdayItem::Every(all(0, 6))],
            true,
        ),
        _ => {
            let mut texts = Vec::new();
            let mut items = Vec::new();
            for _ in 0..rng.usize(1..=2) {
                let day = rng.u32(0..=7);
                let spelled = if rng.u8(..3) == 0 {
                    WEEKDAYS[(day % 7) as usize].to_owned()
                } else {
                    day.to_string()
                };
                let set = BTreeSet::from([day % 7]);
                match rng.u8(..5) {
                    0 => {
                        let nth = rng.u32(1..=5);
                        texts.push(format!("{spelled}#{nth}"));
                        items.push(WeekdayItem::Nth(set, nth));
                    }
                    1 => {
                        texts.push(format!("{spelled}L"));
                        items.push(WeekdayItem::Last(set));
                    }
                    2 => {
                        let end = rng.u32(day.min(6)..=6);
                        let start = day.min(6);
                        texts.push(format!("{start}-{end}"));
                        items.push(WeekdayItem::Every((start..=end).collect()));
                    }
                    _ => {
                        texts.push(spelled);
                        items.push(WeekdayItem::Every(set));
                    }
                }
            }
            (texts.join(","), items, false)
        }
    };
    let both_days = !star_weekdays && rng.u8(..4) == 0;
    let weekdays_text = if both_days {
        format!("+{weekdays_text}")
    } else {
        weekdays_text
    };
    let mut fields = Vec::new();
    if with_seconds {
        fields.push(seconds_text);
    }
    fields.extend([
        minutes_text,
        hours_text,
        days_text,
        months_text,
        weekdays_text,
    ]);
    let meaning = Meaning {
        seconds,
        minutes,
        hours,
        months,
        days,
        weekdays,
        star_days,
        star_weekdays,
        both_days,
        fixed: seconds_fixed && minutes_fixed && hours_fixed,
    };
    (fields.join(" "), meaning)
}

fn meaning_of(expression: &str) -> Meaning {
    // The hand-written cases below only use plain fields, `*` and single numbers.
    let fields: Vec<&str> = expression.split_whitespace().collect();
    let (seconds, rest) = if fields.len() == 6 {
        (fields[0], &fields[1..])
    } else {
        ("0", &fields[..])
    };
    let parse = |field: &str, lo: u32, hi: u32| -> (BTreeSet<u32>, bool) {
        if field == "*" {
            (all(lo, hi), false)
        } else if let Some(step) = field.strip_prefix("*/") {
            let step: usize = step.parse().unwrap();
            ((lo..=hi).step_by(step).collect(), false)
        } else if let Some((a, b)) = field.split_once('-') {
            (all(a.parse().unwrap(), b.parse().unwrap()), false)
        } else {
            let values: BTreeSet<u32> = field.split(',').map(|v| v.parse().unwrap()).collect();
            let single = values.len() == 1;
            (values, single)
        }
    };
    let (seconds, seconds_fixed) = parse(seconds, 0, 59);
    let (minutes, minutes_fixed) = parse(rest[0], 0, 59);
    let (hours, hours_fixed) = parse(rest[1], 0, 23);
    let (days, _) = parse(rest[2], 1, 31);
    let (months, _) = parse(rest[3], 1, 12);
    let (weekdays, _) = parse(rest[4], 0, 7);
    Meaning {
        seconds,
        minutes,
        hours,
        months,
        days: vec![DayItem::Days(days)],
        weekdays: vec![WeekdayItem::Every(weekdays.iter().map(|d| d % 7).collect())],
        star_days: rest[2] == "*",
        star_weekdays: rest[4] == "*",
        both_days: false,
        fixed: seconds_fixed && minutes_fixed && hours_fixed,
    }
}

async fn clock(client: &Client) -> DateTime<Utc> {
    client
        .query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0)
}

/// Declares the schedules `(name, cron, zone)` on `queue` and returns each one's next tick with
/// the clock readings before and after the declarations.
async fn declare(
    client: &Client,
    queue: &str,
    schedules: &[(String, String, &str)],
) -> (Vec<DateTime<Utc>>, DateTime<Utc>, DateTime<Utc>) {
    let before = clock(client).await;
    for (name, cron, zone) in schedules {
        client
            .execute(
                "SELECT inbox_schedule($1::text::regclass, $2, $3, '{}', $4)",
                &[&queue, name, cron, zone],
            )
            .await
            .unwrap_or_else(|e| panic!("{cron} in {zone}: {e}"));
    }
    let after = clock(client).await;
    let mut ticks = Vec::new();
    for (name, _, _) in schedules {
        ticks.push(
            client
                .query_one(
                    "SELECT next_tick FROM inbox_schedules($1::text::regclass) WHERE name = $2",
                    &[&queue, name],
                )
                .await
                .unwrap()
                .get(0),
        );
    }
    (ticks, before, after)
}

/// Checks that `tick` is the reference's next tick after `before` or after `after`.
fn check_next(
    cron: &str,
    zone: Tz,
    meaning: &Meaning,
    tick: DateTime<Utc>,
    before: DateTime<Utc>,
    after: DateTime<Utc>,
    window: Duration,
) {
    let early = meaning.next_after(zone, before, window);
    let late = meaning.next_after(zone, after, window);
    assert!(
        Some(tick) == early || Some(tick) == late,
        "{cron} in {zone}: next tick {tick}, expected {early:?} or {late:?} ({meaning:?})"
    );
}

/// The first instant after `from` at which `zone`'s UTC offset grows (`spring`) or shrinks.
fn next_change(zone: Tz, from: DateTime<Utc>, spring: bool) -> DateTime<Utc> {
    use chrono::Offset;
    let offset = |at: DateTime<Utc>| at.with_timezone(&zone).offset().fix().local_minus_utc();
    let mut at = truncate(from, Duration::hours(1));
    loop {
        let next = at + Duration::hours(1);
        let (a, b) = (offset(at), offset(next));
        if (spring && b > a) || (!spring && b < a) {
            // Changes happen on the hour in the zones used here.
            return next;
        }
        at = next;
        assert!(at < from + Duration::days(800), "{zone} has no DST change");
    }
}

async fn queue(db: &TestDb) -> Client {
    let client = db.client().await;
    client
        .batch_execute("SELECT inbox_create_queue('jobs')")
        .await
        .unwrap();
    client
}

/// schedule.rs's unit tests, each moved to the next time its case happens after today.
#[tokio::test]
async fn the_unit_cases_at_the_next_dst_changes() {
    let db = TestDb::new().await;
    let client = queue(&db).await;
    let berlin: Tz = "Europe/Berlin".parse().unwrap();
    let new_york: Tz = "America/New_York".parse().unwrap();
    let today = clock(&client).await;
    let spring = next_change(berlin, today, true);
    let autumn = next_change(berlin, today, false);
    let ny_spring = next_change(new_york, today, true);
    let local = |zone: Tz, at: DateTime<Utc>| at.with_timezone(&zone).date_naive();
    let (spring_day, autumn_day, ny_day) = (
        local(berlin, spring),
        local(berlin, autumn),
        local(new_york, ny_spring),
    );
    let ny_winter = ny_day - Duration::days(60);
    let cases: Vec<(String, String, &str)> = vec![
        // 02:30 is skipped: that day's tick is at the end of the gap, once.
        (
            "gap".into(),
            format!("30 2 {} {} *", spring_day.day(), spring_day.month()),
            "Europe/Berlin",
        ),
        // 02:30 happens twice: it fires at the first.
        (
            "repeat".into(),
            format!("30 2 {} {} *", autumn_day.day(), autumn_day.month()),
            "Europe/Berlin",
        ),
        // An interval schedule in the repeated hour: its first tick is the first pass's.
        (
            "repeat_interval".into(),
            format!("*/20 2 {} {} *", autumn_day.day(), autumn_day.month()),
            "Europe/Berlin",
        ),
        // An interval schedule over the gap fires at the first hour after it.
        (
            "gap_interval".into(),
            format!("0 * {} {} *", spring_day.day(), spring_day.month()),
            "Europe/Berlin",
        ),
        // Local time is kept across DST.
        (
            "ny_summer".into(),
            format!("0 9 {} {} *", ny_day.day() + 1, ny_day.month()),
            "America/New_York",
        ),
        (
            "ny_winter".into(),
            format!("0 9 {} {} *", ny_winter.day(), ny_winter.month()),
            "America/New_York",
        ),
        // Fridays and the 13th.
        ("either_day".into(), "0 0 13 * 5".into(), "UTC"),
        ("minutes".into(), "*/20 * * * *".into(), "UTC"),
        ("seconds".into(), "*/20 * * * * *".into(), "UTC"),
    ];
    let (ticks, before, after) = declare(&client, "jobs", &cases).await;
    let window = Duration::days(800);
    for ((_, cron, zone), tick) in cases.iter().zip(&ticks) {
        let zone: Tz = zone.parse().unwrap();
        check_next(cron, zone, &meaning_of(cron), *tick, before, after, window);
    }
    let at = |date: NaiveDate, h, m, zone: Tz, earliest: bool| {
        let local = zone.from_local_datetime(&date.and_hms_opt(h, m, 0).unwrap());
        if earliest {
            local.earliest()
        } else {
            local.latest()
        }
        .unwrap()
        .with_timezone(&Utc)
    };
    assert_eq!(ticks[0], spring, "the gap's tick is the end of the gap");
    assert_eq!(ticks[1], at(autumn_day, 2, 30, berlin, true));
    assert_eq!(ticks[2], at(autumn_day, 2, 0, berlin, true));
    assert_eq!(ticks[3], at(spring_day, 0, 0, berlin, true));
    assert_eq!(
        ticks[4].with_timezone(&new_york).time(),
        chrono::NaiveTime::from_hms_opt(9, 0, 0).unwrap()
    );
    assert_eq!(ticks[4].hour(), 13);
    assert_eq!(ticks[5].hour(), 14);
    assert_eq!(ticks[7].second(), 0);
    assert_eq!(ticks[7].minute() % 20, 0);
    assert_eq!(ticks[8].second() % 20, 0);
    assert!(ticks[8] > before && ticks[8] <= after + Duration::seconds(20));
}

/// Invalid expressions and zones fail with 22023, naming what is wrong.
#[tokio::test]
async fn invalid_expressions_and_zones_are_22023() {
    let db = TestDb::new().await;
    let client = queue(&db).await;
    for (cron, zone, says) in [
        ("* * * *", "UTC", "invalid cron expression \"* * * *\""),
        ("0 0 1 1 * * 2030", "UTC", "invalid cron expression"),
        ("* * * * *", "utc", "unknown time zone \"utc\""),
        (
            "61 * * * *",
            "UTC",
            "invalid cron expression \"61 * * * *\"",
        ),
        ("0/5 * * * *", "UTC", "invalid cron expression"),
        ("5L * * * *", "UTC", "invalid cron expression"),
        ("* * 5#2 * *", "UTC", "invalid cron expression"),
        ("* * * * 1#6", "UTC", "invalid cron expression"),
        ("* * 32 * *", "UTC", "invalid cron expression"),
        ("* * * 13 *", "UTC", "invalid cron expression"),
        ("* * * * 8", "UTC", "invalid cron expression"),
        ("*/0 * * * *", "UTC", "invalid cron expression"),
        ("5-1 * * * *", "UTC", "invalid cron expression"),
        ("@often", "UTC", "invalid cron expression"),
        ("", "UTC", "invalid cron expression"),
        ("0 0 30 2 *", "UTC", "no tick after"),
        ("0 0 31 4 *", "UTC", "no tick after"),
    ] {
        let error = client
            .execute(
                "SELECT inbox_schedule('jobs', 'bad', $1, '{}', $2)",
                &[&cron, &zone],
            )
            .await
            .expect_err(cron);
        let error = error.as_db_error().expect("a server error");
        assert_eq!(error.code().code(), "22023", "{cron}: {}", error.message());
        assert!(
            error.message().contains(says),
            "{cron}: {}",
            error.message()
        );
    }
    let stored: i64 = client
        .query_one("SELECT count(*) FROM inbox_schedules('jobs')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, 0);
}

/// Nicknames, names, `?` and `7` read as their plain equivalents.
#[tokio::test]
async fn spellings_that_mean_the_same() {
    let db = TestDb::new().await;
    let client = queue(&db).await;
    let pairs = [
        ("@hourly", "0 * * * *"),
        ("@daily", "0 0 * * *"),
        ("@weekly", "0 0 * * 0"),
        ("@monthly", "0 0 1 * *"),
        ("@yearly", "0 0 1 1 *"),
        ("@annually", "0 0 1 1 *"),
        ("0 12 ? JAN-MAR MON-FRI", "0 12 * 1-3 1-5"),
        ("0 12 * * 7", "0 12 * * 0"),
        ("0 12 * * sun", "0 12 * * 0"),
        ("0 0 12 * * *", "0 12 * * *"),
    ];
    let mut schedules = Vec::new();
    for (n, (a, b)) in pairs.iter().enumerate() {
        schedules.push((format!("a{n}"), a.to_string(), "Europe/Paris"));
        schedules.push((format!("b{n}"), b.to_string(), "Europe/Paris"));
    }
    let (ticks, _, _) = declare(&client, "jobs", &schedules).await;
    for (n, (a, b)) in pairs.iter().enumerate() {
        assert_eq!(ticks[2 * n], ticks[2 * n + 1], "{a} and {b}");
    }
}

/// A few hundred generated expressions in several zones: the next tick is the reference's.
#[tokio::test]
async fn generated_expressions_match_the_reference() {
    let db = TestDb::new().await;
    let client = queue(&db).await;
    let zones = [
        "UTC",
        "Europe/Berlin",
        "America/New_York",
        "Australia/Lord_Howe",
        "Asia/Kolkata",
        "America/Santiago",
        "Pacific/Chatham",
    ];
    let mut rng = fastrand::Rng::with_seed(0x5eed_c404);
    let window = Duration::days(400);
    let start = clock(&client).await;
    let mut cases = Vec::new();
    while cases.len() < 300 {
        let (cron, meaning) = generate(&mut rng);
        let zone = zones[rng.usize(..zones.len())];
        let tz: Tz = zone.parse().unwrap();
        // Expressions that fire too rarely for the brute-force reference are left out.
        let window = if meaning.step() < Duration::minutes(1) {
            Duration::days(1)
        } else {
            window
        };
        if meaning.next_after(tz, start, window).is_none() {
            continue;
        }
        cases.push((cron, meaning, zone));
    }
    for chunk in cases.chunks(50) {
        let schedules: Vec<(String, String, &str)> = chunk
            .iter()
            .enumerate()
            .map(|(n, (cron, _, zone))| (format!("s{n:03}"), cron.clone(), *zone))
            .collect();
        client
            .batch_execute("DELETE FROM jobs; SELECT inbox_unschedule('jobs', name) FROM inbox_schedules('jobs')")
            .await
            .unwrap();
        let (ticks, before, after) = declare(&client, "jobs", &schedules).await;
        for ((cron, meaning, zone), tick) in chunk.iter().zip(ticks) {
            let window = if meaning.step() < Duration::minutes(1) {
                Duration::days(2)
            } else {
                window
            };
            check_next(
                cron,
                zone.parse().unwrap(),
                meaning,
                tick,
                before,
                after,
                window,
            );
        }
    }
}

/// Ticks missed while no one leased fire as one job, for the latest of them, at the next lease;
/// the schedule's next tick is then the first after that lease.
#[tokio::test]
async fn missed_ticks_fire_as_the_latest_at_the_next_lease() {
    let db = TestDb::new().await;
    let client = queue(&db).await;
    let cases = [
        ("every_second", "* * * * * *", "UTC", Duration::hours(1)),
        ("weekly", "0 3 * * 0", "UTC", Duration::days(22)),
        (
            "paris_daily",
            "30 2 * * *",
            "Europe/Paris",
            Duration::days(3),
        ),
        (
            "quarter",
            "*/15 * * * *",
            "America/New_York",
            Duration::hours(5),
        ),
    ];
    let schedules: Vec<(String, String, &str)> = cases
        .iter()
        .map(|(name, cron, zone, _)| (name.to_string(), cron.to_string(), *zone))
        .collect();
    declare(&client, "jobs", &schedules).await;
    for (name, cron, zone, missed) in cases {
        let zone: Tz = zone.parse().unwrap();
        let meaning = meaning_of(cron);
        // Moves the schedule's next tick back to a tick `missed` ago.
        let due = meaning
            .latest_at(
                zone,
                clock(&client).await - missed,
                clock(&client).await - missed * 2,
            )
            .unwrap();
        client
            .execute(
                "UPDATE inbox_periodic_jobs SET next_tick = $2 \
                  WHERE queue = 'jobs'::regclass AND name = $1",
                &[&name, &due],
            )
            .await
            .unwrap();
        let before = clock(&client).await;
        let rows = client
            .query("SELECT payload FROM inbox_lease('jobs', 10)", &[])
            .await
            .unwrap();
        let after = clock(&client).await;
        assert!(!rows.is_empty(), "{cron}: the lease took the tick's job");
        let fired: Vec<(String, i32)> = client
            .query(
                "SELECT key, attempt FROM jobs WHERE key LIKE 'schedule:' || $1 || ':%'",
                &[&name],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        assert_eq!(
            fired.len(),
            1,
            "{cron}: one job for the missed ticks: {fired:?}"
        );
        let key = &fired[0].0;
        let tick =
            DateTime::parse_from_rfc3339(key.strip_prefix(&format!("schedule:{name}:")).unwrap())
                .unwrap()
                .with_timezone(&Utc);
        let latest_early = meaning.latest_at(zone, before, due).unwrap();
        let latest_late = meaning.latest_at(zone, after, due).unwrap();
        assert!(
            tick == latest_early || tick == latest_late,
            "{cron}: fired {tick}, expected {latest_early} or {latest_late}"
        );
        let next: DateTime<Utc> = client
            .query_one(
                "SELECT next_tick FROM inbox_schedules('jobs') WHERE name = $1",
                &[&name],
            )
            .await
            .unwrap()
            .get(0);
        check_next(cron, zone, &meaning, next, before, after, Duration::days(8));
        client.batch_execute("DELETE FROM jobs").await.unwrap();
    }
}
