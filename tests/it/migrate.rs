//! Migrations: applied once under a lock, checksummed, and usable in any schema.

use std::time::Duration;

use outbox_kit::contract::Schema;
use outbox_kit::schema::{MigrateError, migrate};

use crate::support::checker::check;
use crate::support::process::run_to_end;
use crate::support::{Broker, InProcessRelay, TestDb, admin_url, test_config, unique};

async fn empty_db() -> (String, outbox_kit::db::DbTarget) {
    let name = unique("it");
    let admin = outbox_kit::db::DbTarget::parse(&admin_url()).unwrap();
    let client = admin
        .connect(&Schema::default(), "outbox-it-admin")
        .await
        .unwrap();
    client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    (name.clone(), admin.with_dbname(&name))
}

/// Two relays migrating a fresh database at once: both succeed, each migration once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_apply_once() {
    let (_, target) = empty_db().await;
    let schema = Schema::parse("app").unwrap();
    let mut a = target.connect(&schema, "m1").await.unwrap();
    let mut b = target.connect(&schema, "m2").await.unwrap();
    let (ra, rb) = tokio::join!(migrate(&mut a, &schema), migrate(&mut b, &schema));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(
        ra.applied.len() + rb.applied.len(),
        outbox_kit::schema::MIGRATIONS.len()
    );
    let again = migrate(&mut a, &schema).await.unwrap();
    assert!(again.applied.is_empty());
    assert_eq!(again.already, outbox_kit::schema::MIGRATIONS.len());
}

/// An applied migration whose checksum no longer matches is refused, by the library and
/// by `outbox-relay migrate` (exit 1 with the reason).
#[tokio::test]
async fn a_changed_migration_is_refused() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .execute(
            "UPDATE outbox_schema_migrations SET checksum = 'edited' WHERE version = 1",
            &[],
        )
        .await
        .unwrap();
    let mut c = db.client().await;
    match migrate(&mut c, &db.schema).await {
        Err(MigrateError::Changed { name, .. }) => assert_eq!(name, "0001_outbox.sql"),
        other => panic!("expected Changed, got {other:?}"),
    }
    let (code, _, err) = run_to_end(&["migrate", "--database-url", &db.url()], &[]).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("0001_outbox.sql") && err.contains("must not change"),
        "{err}"
    );
}

/// The relay and the SQL producer work in a schema other than public.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_schema_works_end_to_end() {
    let (name, target) = empty_db().await;
    let schema = Schema::parse("shop_outbox").unwrap();
    let (code, out, err) = run_to_end(
        &[
            "migrate",
            "--database-url",
            &format!("{}/{name}", admin_url().rsplit_once('/').unwrap().0),
            "--schema",
            "shop_outbox",
        ],
        &[],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("applied"), "{out}");
    let db = TestDb {
        name,
        target,
        schema: schema.clone(),
    };
    let broker = Broker::new("#").await;
    let relay = InProcessRelay::start(&db, test_config(&broker));
    // A producer whose search_path does not include the schema, using the function.
    let producer = db
        .target
        .connect(&Schema::default(), "producer")
        .await
        .unwrap();
    let id: uuid::Uuid = producer
        .query_one(
            "SELECT shop_outbox.outbox_enqueue('cart', 'c1', 'checked_out', '{\"total\": 12}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    broker.wait_count(1, Duration::from_secs(20)).await;
    relay.stop().await;
    check(&[id], &broker.received()).assert_clean();
}

/// Event ids default to UUIDv7 whichever way a row is written (plain INSERT,
/// `outbox_enqueue`, the Rust producer): version 7, RFC variant, and the first 48 bits are
/// the millisecond the id was made, so later rows sort after earlier ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_ids_are_time_ordered_uuid_v7() {
    use outbox_kit::producer::{NewEvent, Outbox};
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    };
    let db = TestDb::new().await;
    let client = db.client().await;
    let before = now_ms();
    let plain: uuid::Uuid = client
        .query_one(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('o', '1', 'e', '{}') RETURNING event_id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let enqueued: uuid::Uuid = client
        .query_one("SELECT outbox_enqueue('o', '1', 'e', '{}')", &[])
        .await
        .unwrap()
        .get(0);
    let produced = Outbox::new("public")
        .unwrap()
        .enqueue(
            &client,
            &NewEvent::new("o", "1", "e", serde_json::json!({})),
        )
        .await
        .unwrap();
    let after = now_ms();
    let mut stamps = Vec::new();
    for id in [plain, enqueued, produced] {
        assert_eq!(id.get_version_num(), 7, "{id}");
        assert_eq!(id.get_variant(), uuid::Variant::RFC4122, "{id}");
        let b = id.as_bytes();
        let ms = u64::from_be_bytes([0, 0, b[0], b[1], b[2], b[3], b[4], b[5]]);
        // One clock (same machine); a second of slack for the server's clock reading.
        assert!(
            ms + 1_000 >= before && ms <= after + 1_000,
            "{id}: {ms} not within [{before}, {after}]"
        );
        stamps.push(ms);
    }
    assert!(stamps.is_sorted(), "made one after the other: {stamps:?}");
}

/// `outbox_claim`'s own statements run on plans cached per connection, like its parts'
/// (sql/functions/claim.sql): planned on every call they took a third of a claim's time at
/// 500 events/s. What keeps a cached plan from reading a whole table is checked by
/// `a_small_claim_only_probes_indexes`.
#[tokio::test]
async fn the_claims_own_statements_run_on_cached_plans() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let config: Vec<String> = client
        .query_one(
            "SELECT coalesce(proconfig, '{}') FROM pg_proc
              WHERE proname = 'outbox_claim' AND pronamespace = current_schema()::regnamespace",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        config
            .iter()
            .any(|c| c == "plan_cache_mode=force_generic_plan"),
        "outbox_claim settings: {config:?}"
    );
}

/// Each function file's text as applied under its revision (sha256, hex). A change to a
/// file must raise its revision in kit/src/schema.rs (REPEATABLE) and the pin here:
/// schemas that hold the old revision then get the new bodies at their next migrate.
const FUNCTION_FILES: &[(&str, i32, &str)] = &[(
    "functions/claim.sql",
    1,
    "390606db7833b6aeff6ec105fff8df89a7cd54a5d907bbbec1c290c560412235",
)];

/// The function files are pinned: each carries the revision and text it was applied with.
#[tokio::test]
async fn each_function_file_is_pinned_to_its_revision() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let files: Vec<(String, i32, String)> = outbox_kit::schema::REPEATABLE
        .iter()
        .map(|f| (f.name.to_owned(), f.revision, f.sql.to_owned()))
        .collect();
    let mut found = Vec::new();
    for (name, revision, sql) in &files {
        let sum: String = client
            .query_one(
                "SELECT encode(sha256(convert_to($1::text, 'UTF8')), 'hex')",
                &[sql],
            )
            .await
            .unwrap()
            .get(0);
        found.push((name.clone(), *revision, sum));
    }
    let pinned: Vec<(String, i32, String)> = FUNCTION_FILES
        .iter()
        .map(|(n, r, s)| ((*n).to_owned(), *r, (*s).to_owned()))
        .collect();
    assert_eq!(
        found, pinned,
        "a function file changed: raise its revision in kit/src/schema.rs and pin the new \
         checksum here"
    );
    let recorded: Vec<(String, i32, String)> = client
        .query(
            "SELECT name, revision, checksum FROM outbox_schema_functions ORDER BY name",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(recorded, found, "migrate records what it applied");
}

/// A function file is applied again when the schema holds an older revision of it, left
/// alone under a newer one (an older binary must not put back old bodies), and refused when
/// its text changed under the revision applied.
#[tokio::test]
async fn function_files_are_applied_by_revision() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let mut c = db.client().await;
    let f = &outbox_kit::schema::REPEATABLE[0];
    let again = migrate(&mut c, &db.schema).await.unwrap();
    assert!(again.functions.is_empty(), "applied already: {again:?}");

    // An older revision, and a body from before it: migrate puts the file's back.
    client
        .batch_execute(&format!(
            "UPDATE outbox_schema_functions SET revision = {} WHERE name = '{}';
             ALTER FUNCTION outbox_claim(text, bigint, integer, integer, boolean, integer, bigint,
                 text[], text[], bigint, bigint[]) SET plan_cache_mode = force_custom_plan;",
            f.revision - 1,
            f.name
        ))
        .await
        .unwrap();
    let report = migrate(&mut c, &db.schema).await.unwrap();
    assert_eq!(
        report.functions,
        [format!("{} (revision {})", f.name, f.revision)]
    );
    let mode = || async {
        let config: Vec<String> = client
            .query_one(
                "SELECT proconfig FROM pg_proc
                  WHERE proname = 'outbox_claim' AND pronamespace = current_schema()::regnamespace",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        config
            .into_iter()
            .find(|c| c.starts_with("plan_cache_mode="))
            .unwrap_or_default()
    };
    assert_eq!(mode().await, "plan_cache_mode=force_generic_plan");

    // A newer revision (a newer relay migrated): its bodies stay.
    client
        .batch_execute(&format!(
            "UPDATE outbox_schema_functions SET revision = {}, checksum = 'newer' WHERE name = '{}';
             ALTER FUNCTION outbox_claim(text, bigint, integer, integer, boolean, integer, bigint,
                 text[], text[], bigint, bigint[]) SET plan_cache_mode = force_custom_plan;",
            f.revision + 1,
            f.name
        ))
        .await
        .unwrap();
    let report = migrate(&mut c, &db.schema).await.unwrap();
    assert!(report.functions.is_empty(), "{report:?}");
    assert_eq!(mode().await, "plan_cache_mode=force_custom_plan");

    // The same revision with other text: refused, by the library and by the CLI.
    client
        .batch_execute(&format!(
            "UPDATE outbox_schema_functions SET revision = {}, checksum = 'edited' WHERE name = '{}'",
            f.revision, f.name
        ))
        .await
        .unwrap();
    match migrate(&mut c, &db.schema).await {
        Err(MigrateError::RevisionChanged { name, revision, .. }) => {
            assert_eq!((name.as_str(), revision), (f.name, f.revision));
        }
        other => panic!("expected RevisionChanged, got {other:?}"),
    }
    let (code, _, err) = run_to_end(&["migrate", "--database-url", &db.url()], &[]).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(f.name) && err.contains("raise its revision"),
        "{err}"
    );
}

/// Rows numbered by a claim before migration 0007 and still pending (a relay stopped
/// after its claim) keep their numbers: the next claim returns them first, with the seqs
/// they had, and numbers the key's new row after them; marking writes each row's number.
#[tokio::test]
async fn rows_numbered_before_0007_keep_their_numbers() {
    let (_, target) = empty_db().await;
    let schema = Schema::default();
    let client = target.connect(&schema, "m").await.unwrap();
    let apply = |m: &'static outbox_kit::schema::Migration| {
        let client = &client;
        async move {
            client
                .batch_execute(&format!("BEGIN; {} COMMIT;", m.sql))
                .await
                .unwrap_or_else(|e| panic!("{}: {e}", m.name));
        }
    };
    let (before, after): (Vec<_>, Vec<_>) = outbox_kit::schema::MIGRATIONS
        .iter()
        .partition(|m| m.version < 7);
    for m in before {
        apply(m).await;
    }
    client
        .batch_execute(
            "UPDATE outbox_partitions SET owner = 'r', lease_until = now() + interval '1 hour';
             INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'acct', 'a1', 'e' || g, '{}' FROM generate_series(1, 3) g;",
        )
        .await
        .unwrap();
    // (id, seq) of every row a claim returns, in seq order.
    let claim = || async {
        client
            .query(
                "SELECT id, seq FROM outbox_claim('r', 0, 10, 10, false, 1048576, 1048576)
                  WHERE id IS NOT NULL ORDER BY seq",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get::<_, i64>(0), r.get::<_, i64>(1)))
            .collect::<Vec<_>>()
    };
    let old = claim().await;
    assert_eq!(old.iter().map(|r| r.1).collect::<Vec<_>>(), [1, 2, 3]);
    for m in after {
        apply(m).await;
    }
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('acct', 'a1', 'e4', '{}')",
        )
        .await
        .unwrap();
    let claimed = claim().await;
    assert_eq!(
        &claimed[..3],
        &old[..],
        "the numbered rows, with their numbers"
    );
    assert_eq!(claimed.len(), 4);
    assert_eq!(claimed[3].1, 4, "the new row numbered after them");
    let (ids, seqs): (Vec<i64>, Vec<i64>) = claimed.iter().copied().unzip();
    client
        .execute(
            "UPDATE outbox_events e SET dispatched_at = now(), seq = m.seq
               FROM unnest($1::bigint[], $2::bigint[]) AS m(id, seq) WHERE e.id = m.id",
            &[&ids, &seqs],
        )
        .await
        .unwrap();
    let stored: Vec<i64> = client
        .query("SELECT seq FROM outbox_events ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(stored, [1, 2, 3, 4]);
}

/// A small claim runs its big statements on plans cached per connection, and those plans
/// only probe indexes in nested loops: made on a near-empty table, a cached plan must not
/// read a whole table (it would keep doing so once the table is big; sql/0005).
#[tokio::test]
async fn a_small_claim_only_probes_indexes() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "UPDATE outbox_partitions SET owner = 'r', lease_until = now() + interval '1 hour';
             INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'acct', 'a' || g, 'e', '{}' FROM generate_series(1, 3) g;",
        )
        .await
        .unwrap();
    let claim = "SELECT count(*) FROM outbox_claim('r', 0, 500, 64, false, 1048576, 1048576);\n";
    let plans = explained(&db, &claim.repeat(2)).await;
    assert!(
        plans.contains("using outbox_events_pending_key on outbox_events"),
        "each key's rows are probed by key: {plans}"
    );
    for refused in [
        "Seq Scan on outbox_events",
        "Seq Scan on outbox_key_seq",
        "Bitmap Heap Scan",
        "Hash Join",
        "Hash Left Join",
        "Merge Join",
    ] {
        assert!(!plans.contains(refused), "{refused} in: {plans}");
    }
}

/// A vacuum of an idle outbox leaves statistics that say no row is pending, and they stay
/// so through a burst of events until the next analyze. A claim that sees more candidates
/// analyzes the table, and claims and marks find rows by key and by id: believing the
/// pending indexes empty, Postgres had read every pending row once per key in a claim and
/// once per mark (sql/0007, "Statistics").
#[tokio::test]
async fn claims_and_marks_probe_rows_when_statistics_say_none_are_pending() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "ALTER TABLE outbox_events SET (autovacuum_enabled = off);
             UPDATE outbox_partitions SET owner = 'r', lease_until = now() + interval '1 hour';
             INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, dispatched_at)
             SELECT 'acct', 'a' || (g % 200), 'e', '{}', now() FROM generate_series(1, 400) g;",
        )
        .await
        .unwrap();
    client
        .batch_execute("VACUUM ANALYZE outbox_events")
        .await
        .unwrap();
    // As if that vacuum was a while ago (a claim analyzes at most once per 10 seconds).
    client
        .batch_execute("SELECT pg_stat_reset_single_table_counters('outbox_events'::regclass)")
        .await
        .unwrap();
    let pending = 20_000;
    client
        .batch_execute(&format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'acct', 'a' || (g % 200), 'e', '{{}}' FROM generate_series(1, {pending}) g"
        ))
        .await
        .unwrap();
    let believed = || async {
        let row = client
            .query_one(
                "SELECT null_frac FROM pg_stats
                  WHERE tablename = 'outbox_events' AND attname = 'dispatched_at'",
                &[],
            )
            .await
            .unwrap();
        row.get::<_, f32>(0)
    };
    assert_eq!(
        believed().await,
        0.0,
        "the statistics say nothing is pending"
    );

    let claim = "SELECT array_agg(id)::text AS ids, array_agg(seq)::text AS seqs
                   FROM outbox_claim('r', 0, 500, 64, false, 1048576, 4194304)
                  WHERE id IS NOT NULL \\gset\n";
    let script = format!(
        "PREPARE mark(bigint[], bigint[]) AS {};\n{claim}EXECUTE mark(:'ids', :'seqs');\n{claim}\
         EXECUTE mark(:'ids', :'seqs');\n",
        outbox_relay::relay::claim::MARK
    );
    let plans = explained(&db, &script).await;
    let marked: i64 = client
        .query_one(
            // (The 400 rows inserted as dispatched above are numbered too, at insert.)
            "SELECT count(*) FROM outbox_events WHERE dispatched_at IS NOT NULL AND id > 400",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(marked, 1000, "two claims of 500 rows, marked: {plans}");
    assert!(believed().await > 0.9, "the first claim analyzed the table");
    let again: bool = client
        .query_one("SELECT outbox_refresh_statistics(500)", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!again, "analyzed at most once per 10 seconds");
    // An index scan that returned a quarter of the pending rows (over its loops) read them
    // all: a probe returns a few. (A seq scan may be the right plan on a table this small.)
    let number = |text: &str| -> u64 {
        let digits = text.split(|c: char| !c.is_ascii_digit()).next().unwrap();
        digits.parse().unwrap()
    };
    for line in plans
        .lines()
        .filter(|l| l.contains("Index Scan using outbox_events"))
    {
        let Some((_, counts)) = line.split_once("(actual rows=") else {
            continue; // never executed
        };
        let (rows, loops) = counts.split_once(" loops=").unwrap();
        let returned = number(rows) * number(loops);
        assert!(returned < pending / 4, "{line} in: {plans}");
    }
}

/// Runs a psql script in the test database with every statement's plan (nested ones too,
/// with row counts) logged to psql's stderr, which it returns.
async fn explained(db: &TestDb, script: &str) -> String {
    use tokio::io::AsyncWriteExt;
    let mut psql = tokio::process::Command::new("psql")
        .args([&db.url(), "-X", "-q", "-v", "ON_ERROR_STOP=1"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("psql runs");
    let mut stdin = psql.stdin.take().unwrap();
    stdin
        .write_all(
            format!(
                "LOAD 'auto_explain';
                 SET auto_explain.log_min_duration = 0;
                 SET auto_explain.log_nested_statements = on;
                 SET auto_explain.log_analyze = on;
                 SET auto_explain.log_timing = off;
                 SET client_min_messages = log;
                 {script}"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    drop(stdin);
    let out = psql.wait_with_output().await.unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Migration 0017 replaces `outbox_enqueue` (new optional arguments) and adds the
/// three-argument `outbox_effect_claim` back: each takes the grants of the function it
/// stands for, so a role that could enqueue or claim before the upgrade still can, without
/// roles.sql run again, and PUBLIC still cannot.
#[tokio::test]
async fn migration_0017_keeps_the_grants_of_what_it_replaces() {
    let (_, target) = empty_db().await;
    let schema = Schema::default();
    let client = target.connect(&schema, "m").await.unwrap();
    let role = "outbox_it_migrate_0017";
    let (before, after): (Vec<_>, Vec<_>) = outbox_kit::schema::MIGRATIONS
        .iter()
        .partition(|m| m.version < 17);
    for m in before {
        client
            .batch_execute(&format!("BEGIN; {} COMMIT;", m.sql))
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", m.name));
    }
    client
        .batch_execute(&format!(
            "DO $$ BEGIN CREATE ROLE {role} NOLOGIN;
                 EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$;
             REVOKE ALL ON FUNCTION outbox_enqueue(text, text, text, jsonb, jsonb, timestamptz) FROM PUBLIC;
             GRANT EXECUTE ON FUNCTION outbox_enqueue(text, text, text, jsonb, jsonb, timestamptz) TO {role};
             REVOKE ALL ON FUNCTION outbox_effect_claim(text, text, double precision, double precision, double precision) FROM PUBLIC;
             GRANT EXECUTE ON FUNCTION outbox_effect_claim(text, text, double precision, double precision, double precision) TO {role};"
        ))
        .await
        .unwrap();
    for m in after {
        client
            .batch_execute(&format!("BEGIN; {} COMMIT;", m.sql))
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", m.name));
    }
    let may = |who: &'static str, function: &'static str| {
        let client = &client;
        async move {
            client
                .query_one(
                    "SELECT has_function_privilege($1, $2, 'EXECUTE')",
                    &[&who, &function],
                )
                .await
                .unwrap()
                .get::<_, bool>(0)
        }
    };
    let enqueue =
        "outbox_enqueue(text, text, text, jsonb, jsonb, timestamptz, text, text, text, uuid, text)";
    let claim = "outbox_effect_claim(text, text, double precision)";
    assert!(may(role, enqueue).await, "the role keeps outbox_enqueue");
    assert!(
        may(role, claim).await,
        "the role may claim with three arguments"
    );
    assert!(!may("public", enqueue).await, "PUBLIC stays without");
    assert!(!may("public", claim).await, "PUBLIC stays without");
}

/// An upgrade to numbering at insert (0015) over a table with pending rows, while a relay
/// of the previous version runs: rows it numbered and holds keep their numbers (its marks
/// write the same ones), rows nobody numbered yet get their key's next numbers, and from
/// then on both that relay (calling the same `outbox_claim`) and a new relay publish every
/// key's rows with one seq per event and one event per seq.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_keeps_every_number_while_the_previous_relay_runs() {
    let (name, target) = empty_db().await;
    let schema = Schema::default();
    let client = target.connect(&schema, "m").await.unwrap();
    let apply = |m: &'static outbox_kit::schema::Migration| {
        let client = &client;
        async move {
            client
                .batch_execute(&format!("BEGIN; {} COMMIT;", m.sql))
                .await
                .unwrap_or_else(|e| panic!("{}: {e}", m.name));
        }
    };
    let (before, after): (Vec<_>, Vec<_>) = outbox_kit::schema::MIGRATIONS
        .iter()
        .partition(|m| m.version < 15);
    for m in before {
        apply(m).await;
    }
    let insert = |key: &'static str, n: i32| {
        let client = &client;
        async move {
            client
                .execute(
                    "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                     SELECT 'acct', $1, 'e' || g, '{}' FROM generate_series(1, $2) g",
                    &[&key, &n],
                )
                .await
                .unwrap();
        }
    };
    // The previous relay, 'old', holds every partition; its claim numbers what it returns.
    client
        .batch_execute(
            "UPDATE outbox_partitions SET owner = 'old', lease_until = now() + interval '1 hour'",
        )
        .await
        .unwrap();
    // Keys in partitions other than the one 'old' keeps after the upgrade.
    let kept: i32 = client
        .query_one("SELECT outbox_partition_of('acct', 'old')", &[])
        .await
        .unwrap()
        .get(0);
    let mut others = Vec::new();
    for i in 0.. {
        let key = format!("n{i}");
        let p: i32 = client
            .query_one("SELECT outbox_partition_of('acct', $1)", &[&key])
            .await
            .unwrap()
            .get(0);
        if p != kept {
            others.push(key);
        }
        if others.len() == 3 {
            break;
        }
    }
    let others: Vec<&'static str> = others
        .into_iter()
        .map(|k| &*Box::leak(k.into_boxed_str()))
        .collect();
    let (n1, n2, n3) = (others[0], others[1], others[2]);
    insert("old", 3).await;
    insert(n1, 3).await;
    insert(n2, 3).await;
    // (id, seq) of what a claim by 'old' returns, holding `held`: the previous relay's call.
    let old_claim = |held: Vec<i64>| {
        let client = &client;
        async move {
            client
                .query(
                    "SELECT id, seq, aggregate_id FROM outbox_claim('old', 0, 100, 100, false,
                            1048576, 4194304, '{}', '{}', NULL, $1)
                      WHERE id IS NOT NULL ORDER BY aggregate_id, seq",
                    &[&held],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| {
                    (
                        r.get::<_, i64>(0),
                        r.get::<_, i64>(1),
                        r.get::<_, String>(2),
                    )
                })
                .collect::<Vec<_>>()
        }
    };
    // The previous version's mark, as that relay sends it.
    let old_mark = |rows: Vec<(i64, i64, String)>| {
        let client = &client;
        async move {
            let (ids, seqs): (Vec<i64>, Vec<i64>) = rows.iter().map(|r| (r.0, r.1)).unzip();
            client
                .execute(
                    "UPDATE outbox_events e SET dispatched_at = now(), seq = m.seq
                       FROM unnest($1::bigint[], $2::bigint[]) AS m(id, seq),
                            (SELECT set_config('synchronous_commit', 'off', true)) AS async
                      WHERE e.id = m.id AND coalesce(e.dispatched_at, e.parked_at) IS NULL",
                    &[&ids, &seqs],
                )
                .await
                .unwrap();
        }
    };
    let first = old_claim(vec![]).await;
    assert_eq!(first.len(), 9, "{first:?}");
    // It published and marked n1's first row; the rest it holds, in flight.
    let (done, held): (Vec<_>, Vec<_>) = first.into_iter().partition(|r| r.2 == n1 && r.1 == 1);
    old_mark(done).await;
    // Rows committed after that claim: nobody numbered them.
    insert("old", 2).await;
    insert(n1, 1).await;
    insert(n3, 2).await;

    for m in after {
        apply(m).await;
    }
    // And the function files, as any migration tool applies them after the numbered ones.
    for f in outbox_kit::schema::REPEATABLE {
        client
            .batch_execute(f.sql)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", f.name));
    }

    // The previous relay keeps the partition of key 'old' and gives up the others (a lease
    // round); a new relay takes those over and publishes what is pending there, including
    // the rows 'old' held and never marked.
    client
        .execute(
            "UPDATE outbox_partitions SET owner = NULL, lease_until = '-infinity', epoch = epoch + 1
              WHERE partition <> $1",
            &[&kept],
        )
        .await
        .unwrap();
    let db = TestDb {
        name,
        target: target.clone(),
        schema: schema.clone(),
    };
    let broker = Broker::new("#").await;
    let relay = InProcessRelay::start(&db, test_config(&broker));
    insert(n1, 1).await;

    // The previous relay goes on with its key: its held rows are left out, the others come
    // numbered after them; it marks them all with the numbers it was given.
    let held_old: Vec<_> = held.iter().filter(|r| r.2 == "old").cloned().collect();
    let next = old_claim(held_old.iter().map(|r| r.0).collect()).await;
    assert_eq!(
        next.iter().map(|r| r.1).collect::<Vec<_>>(),
        [4, 5],
        "the key's unnumbered rows, after the held ones"
    );
    old_mark(held_old.clone()).await;
    old_mark(next).await;
    insert("old", 1).await;
    let last = old_claim(vec![]).await;
    assert_eq!(last.iter().map(|r| r.1).collect::<Vec<_>>(), [6]);
    old_mark(last).await;

    // The new relay published the other keys' pending rows: 2 + 1 + 1 of n1, 3 of n2, 2 of n3.
    broker.wait_count(9, Duration::from_secs(30)).await;
    let pending_ids: Vec<uuid::Uuid> = client
        .query(
            "SELECT event_id FROM outbox_events WHERE aggregate_id <> 'old' AND NOT (aggregate_id = $1 AND seq = 1)",
            &[&n1],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    crate::support::wait_for("every row marked", Duration::from_secs(20), || async {
        let n: i64 = client
            .query_one(
                "SELECT count(*) FROM outbox_events WHERE dispatched_at IS NULL",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (n == 0).then_some(())
    })
    .await;
    relay.stop().await;
    check(&pending_ids, &broker.received()).assert_clean();
    for r in broker.received() {
        let (_, key) = r.key();
        let seq = r.seq().unwrap();
        let stored: i64 = client
            .query_one(
                "SELECT seq FROM outbox_events WHERE event_id = $1",
                &[&r.message_id.parse::<uuid::Uuid>().unwrap()],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(seq, stored, "{key}: published with the stored number");
    }
    // Per key: 1..n, one seq per event, one event per seq, in id order (the order the
    // rows were numbered in, by the old claim, the upgrade or the INSERT).
    let keys = client
        .query(
            "SELECT aggregate_id, array_agg(seq ORDER BY id)::text FROM outbox_events
              GROUP BY aggregate_id ORDER BY aggregate_id",
            &[],
        )
        .await
        .unwrap();
    let got: Vec<(String, String)> = keys.iter().map(|r| (r.get(0), r.get(1))).collect();
    let mut want = vec![
        (n1.to_owned(), "{1,2,3,4,5}".to_owned()),
        (n2.to_owned(), "{1,2,3}".to_owned()),
        (n3.to_owned(), "{1,2}".to_owned()),
        ("old".to_owned(), "{1,2,3,4,5,6}".to_owned()),
    ];
    want.sort();
    assert_eq!(got, want);
}
