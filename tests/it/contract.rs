//! The SQL contract: docs/contract.md lists every object of the migrated schema, public
//! (pinned with its arguments, result and columns) or internal (by name); the schema must
//! match, so a changed signature, a dropped object or a silent addition fails here. Also the
//! contract's promises that are SQL: its version, the effects claim's documented
//! three-argument form, and `outbox_enqueue` with every producer column and an idempotency
//! key that never aborts the caller's transaction.

use std::collections::BTreeSet;
use std::time::Duration;

use outbox_kit::producer::{NewEvent, Outbox};
use serde_json::json;
use tokio_postgres::Client;

use crate::support::{TestDb, wait_for};

const CONTRACT_MD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/contract.md");
const CHANGELOG_MD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/CHANGELOG.md");
/// Every database call here has a deadline (a busy machine still answers well within it).
const CALL: Duration = Duration::from_secs(30);

/// What the schema holds, one line per object in docs/contract.md's format: tables, views
/// and sequences by name, every column with its type, every function with its identity
/// arguments and result.
const OBJECTS: &str = "
SELECT line FROM (
  SELECT CASE WHEN c.relkind IN ('v', 'm') THEN 'view '
              WHEN c.relkind = 'S' THEN 'sequence '
              ELSE 'table ' END || c.relname AS line
    FROM pg_class c
   WHERE c.relnamespace = $1::text::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
     -- an identity or serial column's sequence, an extension's objects: not ours to list
     AND NOT EXISTS (SELECT 1 FROM pg_depend d
                      WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                        AND d.deptype IN ('i', 'a', 'e'))
  UNION ALL
  SELECT 'column ' || c.relname || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
    FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
   WHERE c.relnamespace = $1::text::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm')
     AND a.attnum > 0 AND NOT a.attisdropped
  UNION ALL
  SELECT 'function ' || p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ') -> '
         || pg_get_function_result(p.oid)
    FROM pg_proc p
   WHERE p.pronamespace = $1::text::regnamespace
     AND NOT EXISTS (SELECT 1 FROM pg_depend d
                      WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e')
) x ORDER BY 1";

/// The lines of the fenced block ```` ```<tag> ```` in `text`.
fn block(text: &str, tag: &str) -> Vec<String> {
    let mut lines = text.lines().skip_while(|l| l.trim() != format!("```{tag}"));
    assert!(
        lines.next().is_some(),
        "docs/contract.md has no ```{tag} block"
    );
    lines
        .take_while(|l| !l.starts_with("```"))
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The object a line names, for the internal list: `function outbox_claim(...) -> ...` and
/// `function outbox_claim` are both `function outbox_claim`; a column is its table's.
fn object_of(line: &str) -> String {
    let (kind, rest) = line.split_once(' ').unwrap_or((line, ""));
    match kind {
        "function" => format!("function {}", rest.split('(').next().unwrap_or(rest)),
        "column" => format!("table {}", rest.split('.').next().unwrap_or(rest)),
        _ => line.to_owned(),
    }
}

async fn with_deadline<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(CALL, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {CALL:?}"))
}

/// The migrated schema holds exactly what docs/contract.md lists: each public line as it
/// is written, each internal object by name, nothing else; and the version it states is the
/// one `outbox_contract_version()` returns and CHANGELOG.md describes.
#[tokio::test]
async fn the_schema_is_the_documented_contract() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let doc = std::fs::read_to_string(CONTRACT_MD).unwrap();
    let mut public: BTreeSet<String> = block(&doc, "contract-public").into_iter().collect();
    let internal: BTreeSet<String> = block(&doc, "contract-internal").into_iter().collect();
    let version_line = public
        .iter()
        .find(|l| l.starts_with("version "))
        .cloned()
        .expect("the public list states its version");
    public.remove(&version_line);
    assert!(
        public.len() > 50 && internal.len() > 10,
        "expected the listed objects"
    );

    let actual: BTreeSet<String> = with_deadline(
        "list the schema's objects",
        client.query(OBJECTS, &[&db.schema.as_str()]),
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect();

    let changed_or_dropped: Vec<&String> = public.difference(&actual).collect();
    let unlisted: Vec<&String> = actual
        .iter()
        .filter(|l| !public.contains(*l) && !internal.contains(&object_of(l)))
        .collect();
    let internal_gone: Vec<&String> = internal
        .iter()
        .filter(|i| !actual.iter().any(|l| &object_of(l) == *i))
        .collect();
    let listed_twice: Vec<&String> = public
        .iter()
        .filter(|l| internal.contains(&object_of(l)))
        .collect();
    assert!(
        changed_or_dropped.is_empty(),
        "public objects listed in docs/contract.md that the schema no longer has as written \
         (a changed signature must keep its old form as a wrapper): {changed_or_dropped:#?}\n\
         the schema has instead: {unlisted:#?}"
    );
    assert!(
        unlisted.is_empty(),
        "objects in the schema that docs/contract.md lists nowhere; add each line to \
         ```contract-public (and a CHANGELOG.md line) or its name to ```contract-internal: \
         {unlisted:#?}"
    );
    assert!(
        internal_gone.is_empty(),
        "internal objects listed in docs/contract.md that the schema no longer has: {internal_gone:#?}"
    );
    assert!(
        listed_twice.is_empty(),
        "objects listed both public and internal: {listed_twice:#?}"
    );

    let version: i32 = with_deadline(
        "outbox_contract_version()",
        client.query_one("SELECT outbox_contract_version()", &[]),
    )
    .await
    .unwrap()
    .get(0);
    assert_eq!(
        version_line,
        format!("version {version}"),
        "docs/contract.md states the version outbox_contract_version() returns"
    );
    let changelog = std::fs::read_to_string(CHANGELOG_MD).unwrap();
    assert!(
        changelog.contains(&format!("Contract version {version}")),
        "CHANGELOG.md says what contract version {version} changed"
    );
}

/// The documented three-argument `outbox_effect_claim(key, worker, lease_secs)`, dropped by
/// migration 0010, claims as it did: one row `queued -> sending` with the lease, no row for
/// a second claim, the budget reserved in the same statement (out of budget: OB001, nothing
/// changed). A lease of zero or less is refused.
#[tokio::test]
async fn the_three_argument_effect_claim_works_again() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let sql = |s: &'static str| with_deadline(s, client.query(s, &[]));
    sql("SELECT outbox_effect_enqueue('receipt:42', 'mail', '{\"to\": \"a@example.com\"}')")
        .await
        .unwrap();
    let rows = sql(
        "SELECT id, destination, attempts FROM outbox_effect_claim('receipt:42', 'billing-7', 60)",
    )
    .await
    .expect("the documented three-argument call");
    assert_eq!(rows.len(), 1, "the first claim gets the row");
    assert_eq!(rows[0].get::<_, String>(1), "mail");
    assert_eq!(rows[0].get::<_, i32>(2), 1);
    let state = sql("SELECT state, claimed_by FROM outbox_effects WHERE effect_key = 'receipt:42'")
        .await
        .unwrap();
    assert_eq!(state[0].get::<_, String>(0), "sending");
    assert_eq!(state[0].get::<_, String>(1), "billing-7");
    let lease: String = with_deadline(
        "lease",
        client.query_one(
            "SELECT (lease_until - claimed_at)::text FROM outbox_effects WHERE effect_key = 'receipt:42'",
            &[],
        ),
    )
    .await
    .unwrap()
    .get(0);
    assert_eq!(lease, "00:01:00", "the lease is the one asked for");
    let again = sql("SELECT * FROM outbox_effect_claim('receipt:42', 'billing-8', 60)")
        .await
        .unwrap();
    assert!(again.is_empty(), "a claimed effect is not claimed twice");

    // Out of budget: OB001 and the claim rolls back with it.
    sql("SELECT outbox_budget_set('acme', 'mail', 0)")
        .await
        .unwrap();
    sql("SELECT outbox_effect_enqueue('receipt:43', 'mail', '{}', 'acme', 'mail', 1)")
        .await
        .unwrap();
    let err = sql("SELECT * FROM outbox_effect_claim('receipt:43', 'billing-7', 60)")
        .await
        .expect_err("out of budget");
    assert_eq!(err.code().map(|c| c.code()), Some("OB001"), "{err}");
    let still: String = with_deadline(
        "state",
        client.query_one(
            "SELECT state FROM outbox_effects WHERE effect_key = 'receipt:43'",
            &[],
        ),
    )
    .await
    .unwrap()
    .get(0);
    assert_eq!(still, "queued");

    let err = sql("SELECT * FROM outbox_effect_claim('receipt:43', 'billing-7', 0)")
        .await
        .expect_err("a zero lease is refused");
    assert_eq!(err.code().map(|c| c.code()), Some("22023"), "{err}");
}

/// `outbox_enqueue` writes every producer column; the six-argument calls of the earlier
/// contract, by position and by name, still work.
#[tokio::test]
async fn enqueue_writes_every_producer_column_and_old_calls_work() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let old_positional: uuid::Uuid = with_deadline(
        "positional",
        client.query_one(
            "SELECT outbox_enqueue('order', '1', 'order.paid', '{}'::jsonb, '{\"t\": \"a\"}', now())",
            &[],
        ),
    )
    .await
    .expect("the six-argument positional call")
    .get(0);
    let old_named: uuid::Uuid = with_deadline(
        "named",
        client.query_one(
            "SELECT outbox_enqueue('order', '1', 'order.paid', '{}'::jsonb,
                                   available_at => now(), headers => '{}')",
            &[],
        ),
    )
    .await
    .expect("the call by name")
    .get(0);
    assert_ne!(old_positional, old_named);

    let mine = uuid::Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0042);
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let id: uuid::Uuid = with_deadline(
        "every column",
        client.query_one(
            "SELECT outbox_enqueue('order', '2', 'order.shipped', '{\"n\": 2}'::jsonb,
                                   routing_key => 'orders.special', traceparent => $1,
                                   tracestate => 'vendor=x', event_id => $2)",
            &[&tp, &mine],
        ),
    )
    .await
    .unwrap()
    .get(0);
    assert_eq!(id, mine, "the caller's event id is the event's");
    let row = with_deadline(
        "row",
        client.query_one(
            "SELECT routing_key, traceparent, tracestate, idempotency_key IS NULL
               FROM outbox_events WHERE event_id = $1",
            &[&mine],
        ),
    )
    .await
    .unwrap();
    assert_eq!(row.get::<_, String>(0), "orders.special");
    assert_eq!(row.get::<_, String>(1), tp);
    assert_eq!(row.get::<_, String>(2), "vendor=x");
    assert!(row.get::<_, bool>(3));
}

/// A second enqueue with the same key, in the same transaction or a later one, inserts
/// nothing, raises nothing and returns the first event's id; the key is per aggregate type.
#[tokio::test]
async fn an_idempotency_key_enqueues_once() {
    let db = TestDb::new().await;
    let mut client = db.client().await;
    const ENQ: &str = "SELECT outbox_enqueue($1, '42', 'order.paid', '{}'::jsonb,
                                             idempotency_key => 'request-7')";
    let tx = client.transaction().await.unwrap();
    let first: uuid::Uuid = with_deadline("first", tx.query_one(ENQ, &[&"order"]))
        .await
        .unwrap()
        .get(0);
    let second: uuid::Uuid = with_deadline("second", tx.query_one(ENQ, &[&"order"]))
        .await
        .expect("a taken key raises nothing")
        .get(0);
    assert_eq!(first, second);
    let other_type: uuid::Uuid = with_deadline("other type", tx.query_one(ENQ, &[&"invoice"]))
        .await
        .unwrap()
        .get(0);
    assert_ne!(first, other_type, "the key is scoped per aggregate_type");
    // The transaction is not aborted: it goes on and commits.
    with_deadline("commit", tx.commit()).await.unwrap();
    let later: uuid::Uuid = with_deadline("later", client.query_one(ENQ, &[&"order"]))
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        later, first,
        "a later transaction gets the first event's id"
    );
    let count = count_events(&client).await;
    assert_eq!(count, 2, "one event per (aggregate_type, key)");
    // The enqueues that inserted nothing took no number: the key's next event is its seq 2
    // (the insert trigger numbers before the unique index is checked, and gives it back).
    with_deadline(
        "next event",
        client.query_one(
            "SELECT outbox_enqueue('order', '42', 'order.shipped', '{}'::jsonb)",
            &[],
        ),
    )
    .await
    .unwrap();
    let seqs: Vec<i64> = with_deadline(
        "seqs",
        client.query(
            "SELECT seq FROM outbox_events WHERE aggregate_type = 'order' ORDER BY seq",
            &[],
        ),
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect();
    assert_eq!(seqs, vec![1, 2], "no number is left without an event");
}

/// How many rows `outbox_events` has.
async fn count_events(client: &Client) -> i64 {
    with_deadline(
        "count",
        client.query_one("SELECT count(*) FROM outbox_events", &[]),
    )
    .await
    .unwrap()
    .get(0)
}

/// Whether `pid` waits for a lock now.
async fn waits_for_lock(observer: &Client, pid: i32) -> bool {
    with_deadline(
        "pg_stat_activity",
        observer.query_one(
            "SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1",
            &[&pid],
        ),
    )
    .await
    .unwrap()
    .get(0)
}

/// Two transactions enqueue the same key at once: the second waits for the first. When the
/// first commits, the second returns the first's id and its transaction goes on; when the
/// first rolls back, the second inserts its own event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_wait_for_the_first() {
    const ENQ: &str = "SELECT outbox_enqueue('order', '42', 'order.paid', '{}'::jsonb,
                                             idempotency_key => $1)";
    let db = TestDb::new().await;
    let observer = db.client().await;
    for first_commits in [true, false] {
        let key = if first_commits {
            "commit-me"
        } else {
            "roll-me-back"
        };
        let mut a = db.client().await;
        let mut b = db.client().await;
        let b_pid: i32 = with_deadline("pid", b.query_one("SELECT pg_backend_pid()", &[]))
            .await
            .unwrap()
            .get(0);
        let ta = a.transaction().await.unwrap();
        let first: uuid::Uuid = with_deadline("first", ta.query_one(ENQ, &[&key]))
            .await
            .unwrap()
            .get(0);
        let second = tokio::spawn(async move {
            let tb = b.transaction().await.unwrap();
            let id: uuid::Uuid = tb
                .query_one(ENQ, &[&key])
                .await
                .expect("a taken key raises nothing")
                .get(0);
            // Still a live transaction: it runs statements and commits.
            tb.query_one("SELECT 1", &[]).await.unwrap();
            tb.commit().await.unwrap();
            id
        });
        wait_for(
            "the second enqueue waits for the first transaction",
            CALL,
            || async { waits_for_lock(&observer, b_pid).await.then_some(()) },
        )
        .await;
        assert!(!second.is_finished(), "the second enqueue returned early");
        if first_commits {
            with_deadline("commit", ta.commit()).await.unwrap();
        } else {
            with_deadline("rollback", ta.rollback()).await.unwrap();
        }
        let second = with_deadline("the second enqueue", second).await.unwrap();
        let ids: Vec<uuid::Uuid> = with_deadline(
            "rows",
            observer.query(
                "SELECT event_id FROM outbox_events WHERE idempotency_key = $1",
                &[&key],
            ),
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
        if first_commits {
            assert_eq!(second, first, "the second gets the first's event id");
        } else {
            assert_ne!(second, first, "the second inserts its own event");
        }
        assert_eq!(ids, vec![second], "one event holds the key");
    }
}

/// The Rust producer: a key on `NewEvent` enqueues once, in one batch and across calls,
/// and the caller's transaction goes on.
#[tokio::test]
async fn the_rust_producer_enqueues_a_key_once() {
    let db = TestDb::new().await;
    let mut client = db.client().await;
    let outbox = Outbox::new("public").unwrap();
    let keyed = |id: &'static str, key: &'static str| {
        NewEvent::new("order", id, "order.paid", json!({"id": id})).with_idempotency_key(key)
    };
    let tx = client.transaction().await.unwrap();
    let ids = with_deadline(
        "batch",
        outbox.enqueue_many(
            &tx,
            &[
                keyed("1", "a"),
                NewEvent::new("order", "2", "order.paid", json!({})),
                keyed("3", "a"),
                keyed("4", "b"),
            ],
        ),
    )
    .await
    .expect("a batch with a repeated key");
    assert_eq!(ids.len(), 4);
    assert_eq!(
        ids[0], ids[2],
        "the repeated key returns the first event's id"
    );
    assert!(ids[1] != ids[0] && ids[3] != ids[0] && ids[1] != ids[3]);
    let again = with_deadline("again", outbox.enqueue(&tx, &keyed("9", "b")))
        .await
        .expect("a taken key is no error");
    assert_eq!(again, ids[3]);
    with_deadline("commit", tx.commit())
        .await
        .expect("the transaction goes on");
    let later = with_deadline("later", outbox.enqueue(&client, &keyed("1", "a")))
        .await
        .unwrap();
    assert_eq!(later, ids[0]);
    let count = count_events(&client).await;
    assert_eq!(count, 3);
}

/// `outbox-kit` packages with its migrations: `kit/sql` is a link to the top-level `sql/`
/// that cargo follows, `kit/src/schema.rs` includes every migration through it (never from
/// outside the package), and `cargo package --list` carries each file. (A full
/// `cargo package -p outbox-kit`, which compiles the package, passes too; it is not run
/// here because it compiles the kit's dependencies again.)
#[tokio::test]
async fn the_kit_packages_with_its_migrations() {
    let root = env!("CARGO_MANIFEST_DIR");
    let schema_rs = std::fs::read_to_string(format!("{root}/kit/src/schema.rs")).unwrap();
    let outside: Vec<&str> = schema_rs
        .lines()
        .filter(|l| l.contains("include_str!") && !l.contains("include_str!(\"../sql/"))
        .collect();
    assert!(
        outside.is_empty(),
        "kit/src/schema.rs includes files from outside the kit package; include \"../sql/<file>\" \
         (kit/sql links to the top-level sql/): {outside:#?}"
    );
    let linked = std::fs::canonicalize(format!("{root}/kit/sql")).expect("kit/sql exists");
    assert_eq!(
        linked,
        std::fs::canonicalize(format!("{root}/sql")).unwrap(),
        "kit/sql is the top-level sql/ (a symbolic link), so there is one copy of each migration"
    );

    let mut cargo = tokio::process::Command::new(env!("CARGO"));
    cargo
        .args([
            "package",
            "-p",
            "outbox-kit",
            "--list",
            "--allow-dirty",
            "--offline",
        ])
        .current_dir(root)
        .kill_on_drop(true);
    let out = with_deadline("cargo package --list", cargo.output())
        .await
        .expect("run cargo package");
    assert!(
        out.status.success(),
        "cargo package --list: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let files: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    let missing: Vec<String> = outbox_kit::schema::MIGRATIONS
        .iter()
        .map(|m| format!("sql/{}", m.name))
        .chain(
            outbox_kit::schema::REPEATABLE
                .iter()
                .map(|f| format!("sql/{}", f.name)),
        )
        .chain(["sql/roles.sql".to_owned()])
        .filter(|f| !files.contains(f))
        .collect();
    assert!(
        missing.is_empty(),
        "the outbox-kit package lacks {missing:?}; it has {files:#?}"
    );
}
