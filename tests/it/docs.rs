//! Docs match the code. Every flag and environment variable of every command's `--help` is
//! documented, and a flag whose help shows `[default: X]` has a line in its command's section
//! of the docs that states X; the docs' rule for zero durations is what the binary does; every
//! relative link in README.md, BENCHMARKS.md and docs/*.md points to a file (and heading) that
//! exists.
//!
//! Where each command's flags are documented is [`SECTIONS`]: a heading in a file under docs/.
//! Flags a command shares with `run` (`--database-url`, `--schema`, `--log-format`) may be
//! documented once, in the `run` section.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::support::process::{binary, run_to_end};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Each command, the file documenting its flags and the heading of that section.
const SECTIONS: &[(&[&str], &str, &str)] = &[
    (&["run"], "docs/running.md", "## Flags of `run`"),
    (
        &["migrate"],
        "docs/running.md",
        "## `outbox-relay run` and `migrate`",
    ),
    (&["status"], "docs/operating.md", "## Operator commands"),
    (
        &["parked", "list"],
        "docs/operating.md",
        "## Operator commands",
    ),
    (&["redrive"], "docs/operating.md", "## Operator commands"),
    (
        &["replay"],
        "docs/operating.md",
        "## Replaying events: `outbox-relay replay`",
    ),
    (&["reconcile"], "docs/consumer-kit.md", "## The reconciler"),
    (
        &["consumer-release"],
        "docs/consumer-kit.md",
        "### Releasing a blocked key: `outbox-relay consumer-release`",
    ),
    (
        &["consumer-blocked"],
        "docs/consumer-kit.md",
        "### Releasing a blocked key: `outbox-relay consumer-release`",
    ),
    (
        &["group-router"],
        "docs/consumer-kit.md",
        "## Ordered groups in any language: `outbox-relay group-router`",
    ),
    (
        &["demo"],
        "docs/running.md",
        "## Try it: `outbox-relay demo`",
    ),
];

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// README.md, BENCHMARKS.md and every docs/*.md (the pages users read), relative to the root.
fn doc_pages() -> Vec<String> {
    let mut pages = vec!["README.md".to_owned(), "BENCHMARKS.md".to_owned()];
    let mut docs: Vec<String> = std::fs::read_dir(Path::new(ROOT).join("docs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// Lines outside fenced code blocks, with their heading level (0 for a non-heading).
fn headings(text: &str) -> Vec<(usize, &str)> {
    let mut fence = false;
    text.lines()
        .map(|line| {
            if line.starts_with("```") {
                fence = !fence;
                return (0, line);
            }
            let level = line.chars().take_while(|&c| c == '#').count();
            let heading = !fence && level > 0 && line[level..].starts_with(' ');
            (if heading { level } else { 0 }, line)
        })
        .collect()
}

/// The lines of the section under `heading`, up to the next heading of its level or higher.
fn section<'a>(text: &'a str, heading: &str) -> Vec<&'a str> {
    let lines = headings(text);
    let start = lines
        .iter()
        .position(|(level, line)| *level > 0 && *line == heading)
        .unwrap_or_else(|| panic!("no heading {heading:?}"));
    let level = lines[start].0;
    lines[start + 1..]
        .iter()
        .take_while(|(l, _)| *l == 0 || *l > level)
        .map(|(_, line)| *line)
        .collect()
}

/// Whether `needle` occurs in `line` as a whole token (not inside a longer flag or number).
fn has_token(line: &str, needle: &str) -> bool {
    let inner = |c: char| c.is_alphanumeric() || matches!(c, '-' | '_' | '.' | '/' | '%' | ':');
    line.match_indices(needle).any(|(i, _)| {
        let before = line[..i].chars().next_back();
        let after = line[i + needle.len()..].chars().next();
        !before.is_some_and(inner) && !after.is_some_and(inner)
    })
}

/// One option of a `--help` text: the long flag and its `[default: X]`, if it shows one.
struct HelpFlag {
    flag: String,
    default: Option<String>,
}

fn help_flags(help: &str) -> Vec<HelpFlag> {
    let mut flags: Vec<(String, String)> = Vec::new();
    for line in help.lines() {
        let trimmed = line.trim_start();
        let starts_option = trimmed.starts_with("--")
            || (trimmed.starts_with('-') && trimmed.get(2..4) == Some(", "));
        if starts_option {
            let flag = trimmed
                .split([' ', ','])
                .find(|w| w.starts_with("--"))
                .unwrap()
                .to_owned();
            flags.push((flag, trimmed.to_owned()));
        } else if let Some((_, text)) = flags.last_mut() {
            text.push(' ');
            text.push_str(trimmed);
        }
    }
    flags
        .into_iter()
        .filter(|(flag, _)| flag != "--help")
        .map(|(flag, text)| {
            let default = text
                .split_once("[default: ")
                .map(|(_, rest)| rest.split_once(']').expect("closing bracket").0.to_owned());
            HelpFlag { flag, default }
        })
        .collect()
}

/// What `lines` say about `flag`'s default: `None` if no table row is about the flag and no
/// line mentioning it states `default` (the section leaves it to another one).
fn states_default(lines: &[&str], flag: &str, default: &str) -> Option<bool> {
    let states = |line: &&str| has_token(line, default);
    let rows: Vec<&str> = lines
        .iter()
        .filter(|l| l.starts_with('|'))
        .filter(|l| {
            l.split('|')
                .nth(1)
                .is_some_and(|cell| has_token(cell, flag))
        })
        .copied()
        .collect();
    if !rows.is_empty() {
        return Some(rows.iter().any(states));
    }
    lines
        .iter()
        .filter(|l| has_token(l, flag))
        .any(states)
        .then_some(true)
}

async fn help(command: &[&str]) -> String {
    let mut args = command.to_vec();
    args.push("--help");
    let (code, help, _) = run_to_end(&args, &[]).await;
    assert_eq!(code, 0, "{args:?}");
    help
}

/// Every flag of every command is in its section (or `run`'s), with the default `--help`
/// shows; every environment variable `--help` names is somewhere in the docs.
#[tokio::test]
async fn readme_documents_every_flag() {
    let all_docs: String = doc_pages().iter().map(|p| read(p)).collect();
    let run_text = read(SECTIONS[0].1);
    let run_section = section(&run_text, SECTIONS[0].2);
    let mut wrong = Vec::new();
    for &(command, file, heading) in SECTIONS {
        let help = help(command).await;
        let name = command.join(" ");
        let text = read(file);
        let own = section(&text, heading);
        for HelpFlag { flag, default } in help_flags(&help) {
            let mentioned = |lines: &[&str]| lines.iter().any(|l| has_token(l, &flag));
            if !mentioned(&own) && !mentioned(&run_section) {
                wrong.push(format!("{name}: {flag} is not in {file} {heading:?}"));
                continue;
            }
            let Some(default) = default else { continue };
            let stated = states_default(&own, &flag, &default)
                .or_else(|| states_default(&run_section, &flag, &default));
            if stated != Some(true) {
                wrong.push(format!(
                    "{name}: {flag} defaults to {default:?}, which its line in {file} {heading:?} does not say"
                ));
            }
        }
        for word in help.split(|c: char| c.is_whitespace() || c == '[' || c == ']' || c == ',') {
            let word = word.trim_matches(['=', ':', '(', ')', '.']);
            let env = word.chars().all(|c| c.is_ascii_uppercase() || c == '_')
                && word.len() > 3
                && word.contains('_');
            if env && !all_docs.contains(word) {
                wrong.push(format!(
                    "{name}: environment variable {word} is not documented"
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "docs disagree with --help:\n{}",
        wrong.join("\n")
    );
}

/// The docs say durations must be longer than zero; the binary refuses `0s` for every
/// duration flag of `run` (exit 2 naming the flag), and no row of the flags table claims
/// that `0s` does something else.
#[tokio::test]
async fn zero_durations_are_refused_as_documented() {
    let text = read("docs/running.md");
    let flags_section = section(&text, SECTIONS[0].2);
    assert!(
        text.contains("must be longer than zero"),
        "docs/running.md no longer states the zero-duration rule"
    );
    for row in flags_section.iter().filter(|l| l.starts_with('|')) {
        if row.contains("`0s`") {
            assert!(row.contains("refused"), "a row says 0s is accepted: {row}");
        }
    }
    let is_duration = |d: &str| {
        d.starts_with(|c: char| c.is_ascii_digit())
            && ["ms", "s", "m", "h", "d"].iter().any(|u| d.ends_with(u))
    };
    let durations: Vec<String> = help_flags(&help(&["run"]).await)
        .into_iter()
        .filter(|f| f.default.as_deref().is_some_and(is_duration))
        .map(|f| f.flag)
        .collect();
    assert!(
        durations.iter().any(|f| f == "--late-commit-window"),
        "{durations:?}"
    );
    for flag in durations {
        // An accepted 0s would start the relay against a port nothing listens on, retrying
        // forever: the timeout turns that into a failure.
        let child = tokio::process::Command::new(binary())
            .args(["run", "--no-migrate", "--http-listen", "off"])
            .args(["--database-url", "postgres://nobody@127.0.0.1:1/none"])
            .args([flag.as_str(), "0s"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let out = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("{flag} 0s was accepted: the relay started"))
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} 0s: {err}");
        assert!(
            err.contains(&flag) && err.contains("longer than zero"),
            "{flag} 0s: {err}"
        );
    }
}

/// GitHub's anchor for a heading: lowercase, punctuation dropped, spaces as dashes.
fn slug(heading: &str) -> String {
    heading
        .trim_start_matches('#')
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> Vec<String> {
    headings(text)
        .into_iter()
        .filter(|(level, _)| *level > 0)
        .map(|(_, line)| slug(line))
        .collect()
}

/// Relative links (`[text](target)`) outside code blocks.
fn links(text: &str) -> Vec<String> {
    let mut fence = false;
    let mut found = Vec::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fence = !fence;
        }
        if fence {
            continue;
        }
        for (i, _) in line.match_indices("](") {
            let rest = &line[i + 2..];
            if let Some(end) = rest.find(')') {
                found.push(rest[..end].to_owned());
            }
        }
    }
    found
        .into_iter()
        .filter(|l| !l.contains("://") && !l.starts_with("mailto:"))
        .collect()
}

/// The relative links of `page` that name no file or, with a `#fragment` into a Markdown
/// file, no heading it has.
fn broken_links(page: &str) -> Vec<String> {
    let mut broken = Vec::new();
    let text = read(page);
    let dir = Path::new(page).parent().unwrap().to_owned();
    for link in links(&text) {
        let (path, fragment) = match link.split_once('#') {
            Some((p, f)) => (p, Some(f)),
            None => (link.as_str(), None),
        };
        let target: PathBuf = if path.is_empty() {
            PathBuf::from(page)
        } else {
            dir.join(path)
        };
        let full = Path::new(ROOT).join(&target);
        if !full.exists() {
            broken.push(format!("{page}: {link} (no file {})", target.display()));
            continue;
        }
        if let Some(fragment) = fragment.filter(|_| target.extension() == Some("md".as_ref())) {
            let target_text = std::fs::read_to_string(&full).unwrap();
            if !anchors(&target_text).iter().any(|a| a == fragment) {
                broken.push(format!("{page}: {link} (no heading #{fragment})"));
            }
        }
    }
    broken
}

/// Every relative link of the user-facing pages names a file that exists and, with a
/// `#fragment` into a Markdown file, a heading it has.
#[test]
fn every_relative_link_resolves() {
    let broken: Vec<String> = doc_pages().iter().flat_map(|p| broken_links(p)).collect();
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// What ARCHITECTURE.md names in a backticked span: a path (relative to the workspace root)
/// or a test, as `module::test_name` (a `fn` in `tests/it/<module>.rs`) or
/// `path.rs::test_name` (a `fn` in that file).
#[derive(Debug, PartialEq)]
enum Citation {
    Path(String),
    Test { file: String, name: String },
}

/// Extensions that make a backticked word a path even without a `/` (`Cargo.toml`).
const FILE_EXTENSIONS: &[&str] = &[
    "rs", "sql", "md", "sh", "toml", "json", "yaml", "yml", "html", "lock",
];

/// The citations of one backticked span, if it is one. `modules` are the modules of
/// tests/it. Code items (`claim::mark_dispatched`, `DbError::is_transient`) and prose in
/// backticks (`lease/3`, `queued → sending`) are not citations.
fn citation(span: &str, modules: &[String]) -> Option<Citation> {
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-' | ':');
    if span.is_empty() || !span.chars().all(plain) {
        return None;
    }
    let test_name = |n: &str| {
        !n.is_empty()
            && n.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    };
    if let Some((head, name)) = span.rsplit_once("::") {
        if head.ends_with(".rs") && test_name(name) {
            return Some(Citation::Test {
                file: head.to_owned(),
                name: name.to_owned(),
            });
        }
        let module = !head.is_empty() && test_name(head);
        // A test name reads as a sentence; a code item (`claim::mark_dispatched`) does not.
        let known = modules.iter().any(|m| m == head);
        if module && test_name(name) && (known || name.matches('_').count() >= 3) {
            return Some(Citation::Test {
                file: format!("tests/it/{head}.rs"),
                name: name.to_owned(),
            });
        }
        return None;
    }
    let segments: Vec<&str> = span.trim_end_matches('/').split('/').collect();
    let last = segments.last().copied().unwrap_or("");
    let extension = last
        .rsplit_once('.')
        .is_some_and(|(stem, ext)| !stem.is_empty() && FILE_EXTENSIONS.contains(&ext));
    let looks_like_path = (segments.len() > 1 || span.ends_with('/'))
        && segments.iter().all(|s| !s.is_empty())
        && last.chars().any(|c| c.is_ascii_alphabetic());
    (looks_like_path || extension).then(|| Citation::Path(span.to_owned()))
}

/// Every citation of `text` (backticked spans outside fenced code blocks), with its line.
fn citations(text: &str, modules: &[String]) -> Vec<(usize, Citation)> {
    let mut fence = false;
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.starts_with("```") {
            fence = !fence;
            continue;
        }
        if fence {
            continue;
        }
        for span in line.split('`').skip(1).step_by(2) {
            if let Some(c) = citation(span, modules) {
                found.push((n + 1, c));
            }
        }
    }
    found
}

/// What of `cited` does not exist under `root`, one line per citation, saying what is
/// missing and where.
fn missing_citations(page: &str, cited: &[(usize, Citation)], root: &Path) -> Vec<String> {
    let mut missing = Vec::new();
    for (line, c) in cited {
        match c {
            Citation::Path(path) => {
                if !root.join(path).exists() {
                    missing.push(format!(
                        "{page}:{line}: `{path}`: no such file or directory"
                    ));
                }
            }
            Citation::Test { file, name } => match std::fs::read_to_string(root.join(file)) {
                Err(_) => missing.push(format!(
                    "{page}:{line}: `{name}`: no file {file} to hold the test"
                )),
                Ok(source) if !source.contains(&format!("fn {name}(")) => {
                    missing.push(format!("{page}:{line}: `{name}`: no `fn {name}` in {file}"))
                }
                Ok(_) => {}
            },
        }
    }
    missing
}

/// The modules of the integration test binary: the files of tests/it.
fn test_modules() -> Vec<String> {
    std::fs::read_dir(Path::new(ROOT).join("tests/it"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".rs").map(str::to_owned))
        .filter(|n| n != "main")
        .collect()
}

/// Every path and test ARCHITECTURE.md cites exists, and its relative links resolve; the
/// same for the citations of docs/design-notes.md and docs/history.md. A rename that leaves
/// the map behind fails here with the page, the line and the citation.
#[test]
fn architecture_cites_only_what_exists() {
    let page = "ARCHITECTURE.md";
    let cited = citations(&read(page), &test_modules());
    let tests = cited
        .iter()
        .filter(|(_, c)| matches!(c, Citation::Test { .. }))
        .count();
    // The map cites dozens of each; far fewer means the parser lost them.
    assert!(
        tests >= 40 && cited.len() - tests >= 40,
        "{page}: only {tests} tests and {} paths found",
        cited.len() - tests
    );
    let mut wrong = missing_citations(page, &cited, Path::new(ROOT));
    wrong.extend(broken_links(page));
    // The pages it hands the reasoning and the history to cite the same way.
    for page in ["docs/design-notes.md", "docs/history.md"] {
        let cited = citations(&read(page), &test_modules());
        wrong.extend(missing_citations(page, &cited, Path::new(ROOT)));
    }
    assert!(
        wrong.is_empty(),
        "{page} cites what does not exist (fix the citation, or the map if the code moved):\n{}",
        wrong.join("\n")
    );
}

/// The check finds a planted missing path, a missing test in a known module, a test whose
/// module does not exist and a missing unit test, and leaves code items and prose alone.
#[test]
fn the_citation_check_catches_planted_mistakes() {
    let modules = vec!["groups".to_owned(), "docs".to_owned()];
    let text = "\
`src/relay/hand.rs` and `src/relay/no_such.rs`, `sql/` and `Cargo.toml`
`docs::the_citation_check_catches_planted_mistakes` and `groups::no_such_test`
`relay_statee::a_relay_that_never_was_tested` and `src/relay/leases.rs::renewal_and_expiry`
`src/relay/leases.rs::no_such_unit_test`
`claim::mark_dispatched`, `DbError::is_transient`, `lease/3`, `queued → sending`, `0.9`
```text
`src/in/a/fence.rs`
```
";
    let cited = citations(text, &modules);
    assert_eq!(cited.len(), 9, "{cited:?}");
    let missing = missing_citations("MAP.md", &cited, Path::new(ROOT));
    assert_eq!(
        missing,
        [
            "MAP.md:1: `src/relay/no_such.rs`: no such file or directory",
            "MAP.md:2: `no_such_test`: no `fn no_such_test` in tests/it/groups.rs",
            "MAP.md:3: `a_relay_that_never_was_tested`: no file tests/it/relay_statee.rs to hold the test",
            "MAP.md:4: `no_such_unit_test`: no `fn no_such_unit_test` in src/relay/leases.rs",
        ]
    );
}
