//! Docs match the code: every flag and environment variable of every command's `--help`
//! is documented in README.md.

use crate::support::process::run_to_end;

#[tokio::test]
async fn readme_documents_every_flag() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let mut missing = Vec::new();
    for command in [
        &["run"][..],
        &["migrate"],
        &["status"],
        &["parked", "list"],
        &["redrive"],
        &["reconcile"],
        &["demo"],
    ] {
        let mut args = command.to_vec();
        args.push("--help");
        let (code, help, _) = run_to_end(&args, &[]).await;
        assert_eq!(code, 0, "{args:?}");
        for word in help.split(|c: char| c.is_whitespace() || c == '[' || c == ']' || c == ',') {
            let word = word.trim_matches(['=', ':', '(', ')', '.']);
            let flag = word.starts_with("--") && word.len() > 2 && word != "--help";
            let env = word.chars().all(|c| c.is_ascii_uppercase() || c == '_')
                && word.len() > 3
                && word.contains('_');
            if (flag || env) && !readme.contains(word) {
                missing.push(format!("{}: {word}", command.join(" ")));
            }
        }
    }
    assert!(missing.is_empty(), "README does not document: {missing:?}");
}
