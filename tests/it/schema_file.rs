//! sql/schema.sql is the schema the migrations build, in one file to read: a schema-only
//! `pg_dump` of a freshly migrated database (schema `public`), normalised so that it depends
//! only on the migrations (no version header, no session `SET`s, no owners, no random
//! `\restrict` key). The test fails while the file differs from a fresh dump; with
//! `OUTBOX_WRITE_SCHEMA=1` it rewrites the file instead (`scripts/schema-dump` does that).
//!
//! `pg_dump` must match the server's major version: the server's own
//! `/usr/lib/postgresql/<major>/bin/pg_dump` (Debian's layout) is used when it exists, else
//! `PG_DUMP` or the `pg_dump` on PATH, and a mismatch is reported instead of a diff.

use std::path::Path;

use crate::support::TestDb;

const SCHEMA_FILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/sql/schema.sql");

const HEADER: &str = "\
-- The schema that the migrations in sql/ build (in schema `public`), in one place to read.
-- Generated, do not edit: after changing a migration run scripts/schema-dump.
-- tests/it/schema_file.rs fails while this file differs from a fresh dump.
";

/// The pg_dump matching the server's major version, and that version.
async fn pg_dump_for(db: &TestDb) -> (String, i32) {
    let client = db.client().await;
    let num: String = client
        .query_one("SHOW server_version_num", &[])
        .await
        .unwrap()
        .get(0);
    let major = num.parse::<i32>().unwrap() / 10000;
    let debian = format!("/usr/lib/postgresql/{major}/bin/pg_dump");
    let bin = if Path::new(&debian).exists() {
        debian
    } else {
        std::env::var("PG_DUMP").unwrap_or_else(|_| "pg_dump".into())
    };
    (bin, major)
}

/// A dump's session setting (`SET lock_timeout = 0;`), not a statement of a function body.
fn is_session_set(line: &str) -> bool {
    line.strip_prefix("SET ")
        .and_then(|rest| rest.split_once(" = "))
        .is_some_and(|(name, value)| {
            name.chars().all(|c| c.is_ascii_lowercase() || c == '_') && value.ends_with(';')
        })
}

/// What varies between dumps of the same schema goes; blank runs become one blank line.
fn normalise(dump: &str) -> String {
    let noise = |l: &str| {
        l.starts_with("\\restrict ")
            || l.starts_with("\\unrestrict ")
            || is_session_set(l)
            || l.starts_with("SELECT pg_catalog.set_config(")
            || l.starts_with("-- Dumped from database version")
            || l.starts_with("-- Dumped by pg_dump version")
            || l == "-- PostgreSQL database dump"
            || l == "-- PostgreSQL database dump complete"
    };
    let kept: Vec<&str> = dump
        .lines()
        .map(str::trim_end)
        .filter(|l| !noise(l))
        .collect();
    // A bare `--` frames a comment; without its comment (the header) it is noise too.
    let framed = |i: usize| {
        let text = |j: Option<usize>| {
            j.and_then(|j| kept.get(j))
                .is_some_and(|l| l.starts_with("-- "))
        };
        text(i.checked_sub(1)) || text(Some(i + 1))
    };
    let mut out = format!("{HEADER}\n");
    let mut blank = true;
    for (i, line) in kept.iter().enumerate() {
        if *line == "--" && !framed(i) {
            continue;
        }
        if line.is_empty() {
            if !blank {
                out.push('\n');
            }
            blank = true;
            continue;
        }
        out.push_str(line);
        out.push('\n');
        blank = false;
    }
    while out.ends_with("\n\n") {
        out.pop();
    }
    out
}

#[tokio::test]
async fn schema_file_is_a_fresh_dump_of_the_migrations() {
    let db = TestDb::new().await;
    let (bin, major) = pg_dump_for(&db).await;
    let out = tokio::process::Command::new(&bin)
        .args(["--schema-only", "--no-owner", "--dbname"])
        .arg(db.url())
        .output()
        .await
        .unwrap_or_else(|e| panic!("run {bin}: {e}; set PG_DUMP to a pg_dump {major}"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{bin} failed (the server is version {major}; PG_DUMP names another pg_dump): {err}"
    );
    let fresh = normalise(&String::from_utf8(out.stdout).unwrap());
    if std::env::var_os("OUTBOX_WRITE_SCHEMA").is_some() {
        std::fs::write(SCHEMA_FILE, &fresh).unwrap();
        return;
    }
    let file = std::fs::read_to_string(SCHEMA_FILE).unwrap_or_default();
    if file != fresh {
        let first = file
            .lines()
            .zip(fresh.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| file.lines().count().min(fresh.lines().count()));
        let at = |text: &str| {
            text.lines()
                .nth(first)
                .unwrap_or("<end of file>")
                .to_owned()
        };
        panic!(
            "sql/schema.sql is not what the migrations build; regenerate it with \
             scripts/schema-dump (OUTBOX_WRITE_SCHEMA=1 cargo test -p outbox-relay --test it \
             schema_file) and commit it.\nfirst difference, line {}:\n  file:  {}\n  fresh: {}",
            first + 1,
            at(&file),
            at(&fresh)
        );
    }
}

#[test]
fn normalising_drops_the_dump_noise_and_keeps_the_schema() {
    let dump = "--\n-- PostgreSQL database dump\n--\n\n\\restrict abc\n\n\
                -- Dumped from database version 15.20\n-- Dumped by pg_dump version 15.20\n\n\
                SET statement_timeout = 0;\nSELECT pg_catalog.set_config('search_path', '', false);\n\n\
                --\n-- Name: t; Type: TABLE; Schema: public; Owner: -\n--\n\n\n\
                CREATE TABLE public.t (\n    id bigint\n);\n\n\n\
                --\n-- PostgreSQL database dump complete\n--\n\n\\unrestrict abc\n";
    assert_eq!(
        normalise(dump),
        format!(
            "{HEADER}\n--\n-- Name: t; Type: TABLE; Schema: public; Owner: -\n--\n\n\
             CREATE TABLE public.t (\n    id bigint\n);\n"
        )
    );
}
