//! Headless Chromium driven over the DevTools protocol (CDP), for the dashboard test.
//!
//! One browser process per test, its own throw-away profile, killed when the [`Browser`]
//! drops (its helper processes exit with it). One WebSocket to the browser; pages are
//! attached with `flatten`, so every command names its page by `sessionId` on that one
//! socket. Calls are strictly request/answer under a lock, each with a deadline; events
//! that arrive in between are read for what the page reports as broken (uncaught
//! exceptions, `console.error`), which a failing test prints.
//!
//! The binary is `IT_CHROMIUM` or `/usr/bin/chromium` (Debian's `chromium` package, which
//! `scripts/test` installs when missing).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::unique;

/// How long one DevTools command may take.
const CALL_LIMIT: Duration = Duration::from_secs(20);
/// How long Chromium may take to open its DevTools socket.
const START_LIMIT: Duration = Duration::from_secs(30);

pub fn chromium_path() -> PathBuf {
    std::env::var_os("IT_CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"))
}

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

pub struct Browser {
    /// An async lock: a call holds the socket from its request until its answer.
    socket: tokio::sync::Mutex<Socket>,
    next_id: AtomicU64,
    /// What pages reported as broken (uncaught exceptions, console.error).
    problems: Mutex<Vec<String>>,
    /// Chromium's last stderr lines, filled by a task that drains the pipe.
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    child: Child,
    profile: PathBuf,
}

impl Browser {
    /// Starts headless Chromium and connects to its DevTools socket.
    pub async fn start() -> Browser {
        let path = chromium_path();
        assert!(
            path.exists(),
            "{} not found: the dashboard test needs Chromium; install Debian's `chromium` \
             package (apt-get install chromium; ./scripts/test does it) or set IT_CHROMIUM",
            path.display()
        );
        let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        sweep_stale_profiles(&tmp);
        let profile = tmp.join(unique("chromium-profile"));
        std::fs::create_dir_all(&profile).unwrap();
        // As root Chromium needs --no-sandbox; the --disable-* flags keep it from reaching
        // out to the network (there is none here, and waiting for it is slow).
        let mut child = Command::new(&path)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
                "--window-size=1280,1000",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", path.display()));

        // Chromium prints "DevTools listening on ws://127.0.0.1:<port>/devtools/browser/<id>"
        // on stderr once it is ready. Keep reading stderr afterwards so it never blocks on a
        // full pipe, and keep its tail for failure messages.
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let (url_tx, url_rx) = tokio::sync::oneshot::channel();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let tail = stderr_tail.clone();
        tokio::spawn(async move {
            let mut url_tx = Some(url_tx);
            while let Ok(Some(line)) = lines.next_line().await {
                // No D-Bus in a container; Chromium says so at length.
                if line.contains(":ERROR:dbus/") {
                    continue;
                }
                if let Some(url) = line.strip_prefix("DevTools listening on ")
                    && let Some(tx) = url_tx.take()
                {
                    let _ = tx.send(url.trim().to_owned());
                }
                let mut tail = tail.lock().unwrap();
                if tail.len() == 40 {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        });
        let url = match tokio::time::timeout(START_LIMIT, url_rx).await {
            Ok(Ok(url)) => url,
            _ => panic!(
                "chromium did not open its DevTools socket within {START_LIMIT:?}; stderr:\n{}",
                tail_text(&stderr_tail)
            ),
        };
        let (socket, _) = tokio::time::timeout(CALL_LIMIT, tokio_tungstenite::connect_async(&url))
            .await
            .expect("devtools websocket connects in time")
            .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
        Browser {
            socket: tokio::sync::Mutex::new(socket),
            next_id: AtomicU64::new(1),
            problems: Mutex::new(Vec::new()),
            stderr_tail,
            child,
            profile,
        }
    }

    /// Sends one command (to a page when `session` is given) and returns its result.
    async fn call(&self, session: Option<&str>, method: &str, params: Value) -> Value {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut msg = json!({ "id": id, "method": method, "params": params });
        if let Some(s) = session {
            msg["sessionId"] = s.into();
        }
        let mut socket = self.socket.lock().await;
        let answer = tokio::time::timeout(CALL_LIMIT, async {
            socket.send(Message::text(msg.to_string())).await?;
            loop {
                let Some(frame) = socket.next().await else {
                    return Err(tokio_tungstenite::tungstenite::Error::ConnectionClosed);
                };
                let Message::Text(text) = frame? else {
                    continue;
                };
                let v: Value = serde_json::from_str(&text).expect("devtools sends JSON");
                if v["id"] == id {
                    return Ok(v);
                }
                self.note_event(&v);
            }
        })
        .await;
        let v = match answer {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => panic!("devtools {method}: {e}{}", self.diagnostics()),
            Err(_) => panic!(
                "devtools {method}: no answer within {CALL_LIMIT:?}{}",
                self.diagnostics()
            ),
        };
        if let Some(e) = v.get("error") {
            panic!("devtools {method} failed: {e}{}", self.diagnostics());
        }
        v["result"].clone()
    }

    fn note_event(&self, v: &Value) {
        let p = &v["params"];
        let problem = match v["method"].as_str() {
            Some("Runtime.exceptionThrown") => {
                let d = &p["exceptionDetails"];
                Some(format!(
                    "uncaught exception: {}",
                    d["exception"]["description"]
                        .as_str()
                        .or(d["text"].as_str())
                        .unwrap_or("?")
                ))
            }
            Some("Runtime.consoleAPICalled") if p["type"] == "error" => Some(format!(
                "console.error: {}",
                p["args"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|a| a["value"].to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
            )),
            _ => None,
        };
        if let Some(p) = problem {
            self.problems.lock().unwrap().push(p);
        }
    }

    /// What the pages reported as broken, and Chromium's last stderr lines.
    pub fn diagnostics(&self) -> String {
        format!(
            "\npage problems: {:?}\nchromium stderr (tail):\n{}",
            self.problems.lock().unwrap(),
            tail_text(&self.stderr_tail)
        )
    }

    /// Page problems seen so far (uncaught exceptions, console.error).
    pub fn problems(&self) -> Vec<String> {
        self.problems.lock().unwrap().clone()
    }

    /// Opens a new tab at `url` and waits until its document has loaded.
    pub async fn open(&self, url: &str) -> Page<'_> {
        let target = self
            .call(None, "Target.createTarget", json!({ "url": "about:blank" }))
            .await;
        let attached = self
            .call(
                None,
                "Target.attachToTarget",
                json!({ "targetId": target["targetId"], "flatten": true }),
            )
            .await;
        let page = Page {
            browser: self,
            session: attached["sessionId"]
                .as_str()
                .expect("a session id")
                .to_owned(),
        };
        page.call("Runtime.enable", json!({})).await;
        page.call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": 1280, "height": 1000, "deviceScaleFactor": 1, "mobile": false }),
        )
        .await;
        let nav = page.call("Page.navigate", json!({ "url": url })).await;
        assert!(
            nav.get("errorText").is_none(),
            "navigate to {url}: {}",
            nav["errorText"]
        );
        page.wait_until(
            "the page to load",
            "document.readyState === 'complete'",
            Duration::from_secs(20),
        )
        .await;
        page
    }

    /// Closes the browser and waits for it to exit, then removes its profile. (Dropping
    /// kills it instead; a test that panics leaves its profile for the next sweep.)
    pub async fn close(mut self) {
        let _ = tokio::time::timeout(
            CALL_LIMIT,
            self.socket
                .get_mut()
                .send(Message::text(r#"{"id":0,"method":"Browser.close"}"#)),
        )
        .await;
        let exited = tokio::time::timeout(CALL_LIMIT, self.child.wait()).await;
        assert!(
            exited.is_ok(),
            "chromium did not exit within {CALL_LIMIT:?} of Browser.close"
        );
        // Drop removes the profile now that nothing writes to it.
    }
}

/// Removes the profiles of earlier test processes that are gone (`chromium-profile_<pid>_<n>`).
fn sweep_stale_profiles(tmp: &std::path::Path) {
    for entry in std::fs::read_dir(tmp).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name
            .strip_prefix("chromium-profile_")
            .and_then(|rest| rest.split('_').next())
            .and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Kill first (kill_on_drop would only act after this), then remove the profile it
        // wrote to; helper processes still exiting may leave a file for the next sweep.
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

fn tail_text(tail: &Mutex<VecDeque<String>>) -> String {
    tail.lock()
        .unwrap()
        .iter()
        .cloned()
        .collect::<Vec<_>>()
        .join("\n")
}

/// One tab.
pub struct Page<'b> {
    browser: &'b Browser,
    session: String,
}

impl Page<'_> {
    async fn call(&self, method: &str, params: Value) -> Value {
        self.browser.call(Some(&self.session), method, params).await
    }

    /// Evaluates a JavaScript expression (awaiting it if it is a promise) and returns its
    /// value as JSON; panics if it throws.
    pub async fn eval(&self, expression: &str) -> Value {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({ "expression": expression, "returnByValue": true, "awaitPromise": true }),
            )
            .await;
        if let Some(e) = r.get("exceptionDetails") {
            panic!(
                "evaluating `{expression}` threw: {}{}",
                e["exception"]["description"].as_str().unwrap_or("?"),
                self.browser.diagnostics()
            );
        }
        r["result"]["value"].clone()
    }

    /// The text of the element with this id ("" when it has none).
    pub async fn text(&self, id: &str) -> String {
        self.eval(&format!(
            "document.getElementById({}).textContent",
            json!(id)
        ))
        .await
        .as_str()
        .unwrap_or_default()
        .to_owned()
    }

    /// Waits until `expression` is truthy; returns its value. Panics after `limit` with
    /// what the page reported.
    pub async fn wait_until(&self, what: &str, expression: &str, limit: Duration) -> Value {
        let start = Instant::now();
        loop {
            let v = self.eval(expression).await;
            if !matches!(&v, Value::Null | Value::Bool(false)) && v != json!(0) && v != json!("") {
                return v;
            }
            if start.elapsed() > limit {
                let text = self.eval("document.body.innerText").await;
                panic!(
                    "timed out after {limit:?} waiting for {what} (`{expression}` is {v})\n\
                     the page shows:\n{}{}",
                    text.as_str().unwrap_or_default(),
                    self.browser.diagnostics()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Clicks the centre of the element matched by `selector` with real mouse events, as a
    /// person would, once it is there, visible and enabled (waiting up to 10 s for that).
    pub async fn click(&self, selector: &str) {
        let rect = self
            .wait_until(
                &format!("{selector} to be clickable"),
                &format!(
                    "(() => {{ const e = document.querySelector({}); if (!e || e.disabled) return null;
                       e.scrollIntoView({{ block: 'center' }});
                       const r = e.getBoundingClientRect();
                       return r.width > 0 ? {{ x: r.x + r.width / 2, y: r.y + r.height / 2 }} : null; }})()",
                    json!(selector)
                ),
                Duration::from_secs(10),
            )
            .await;
        for kind in ["mousePressed", "mouseReleased"] {
            self.call(
                "Input.dispatchMouseEvent",
                json!({ "type": kind, "x": rect["x"], "y": rect["y"], "button": "left", "clickCount": 1 }),
            )
            .await;
        }
    }

    /// Focuses the field `selector`, clears it, and types `text` into it.
    pub async fn type_into(&self, selector: &str, text: &str) {
        let found = self
            .eval(&format!(
                "(() => {{ const e = document.querySelector({}); if (!e) return false;
                   e.focus(); e.select(); return document.activeElement === e; }})()",
                json!(selector)
            ))
            .await;
        assert_eq!(found, json!(true), "no field to type into at {selector}");
        self.call("Input.insertText", json!({ "text": text })).await;
    }

    /// A PNG of the whole page, written to `path`.
    pub async fn screenshot(&self, path: &std::path::Path) {
        let shot = self
            .call(
                "Page.captureScreenshot",
                json!({ "format": "png", "captureBeyondViewport": true }),
            )
            .await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().expect("screenshot data"))
            .expect("screenshot is base64");
        std::fs::write(path, png).unwrap();
    }
}
