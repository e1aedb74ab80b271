//! [`NatsServer`]: a real NATS server with JetStream on a free loopback port, its store in a
//! directory of its own, started by the test that needs it and stopped when dropped.

use std::fs;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};

/// A `nats-server -js` process. [`restart`](Self::restart) stops it (SIGKILL) and starts it again
/// on the same port with the same store, as a crashed broker comes back.
#[derive(Debug)]
pub struct NatsServer {
    child: Option<Child>,
    dir: PathBuf,
    config: PathBuf,
    port: u16,
}

impl NatsServer {
    /// Starts a server with the default `max_payload` (1 MiB).
    ///
    /// # Panics
    /// When `nats-server` is not installed (the message says how to install it), or does not
    /// listen within 10 s (the message holds its log).
    pub fn start() -> Self {
        Self::start_with_max_payload(None)
    }

    /// Starts a server whose `max_payload` is `max_payload` bytes, when given.
    ///
    /// # Panics
    /// As [`start`](Self::start).
    pub fn start_with_max_payload(max_payload: Option<usize>) -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "inbox-nats-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("create the NATS server's directory");
        let port = crate::free_port();
        let config = dir.join("nats.conf");
        let max_payload = max_payload.map_or(String::new(), |n| format!("max_payload: {n}\n"));
        fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\n{max_payload}jetstream {{\n  store_dir: \"{}\"\n}}\n",
                dir.join("store").display()
            ),
        )
        .expect("write nats.conf");
        let mut server = Self {
            child: None,
            dir,
            config,
            port,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let binary = ["/usr/sbin/nats-server", "/usr/bin/nats-server"]
            .into_iter()
            .find(|path| std::path::Path::new(path).exists())
            .unwrap_or_else(|| {
                panic!(
                    "nats-server is not installed: `apt-get install -y nats-server` \
                     (scripts/lib.sh's ensure_toolchain does it); the outbox tests need a real one"
                )
            });
        let log = fs::File::create(self.dir.join("nats.log")).expect("create nats.log");
        let child = Command::new(binary)
            .arg("-c")
            .arg(&self.config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if Instant::now() > deadline {
                let log = fs::read_to_string(self.dir.join("nats.log")).unwrap_or_default();
                panic!(
                    "nats-server did not listen on {} within 10 s:\n{log}",
                    self.port
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server (SIGKILL) and starts it again on the same port and store.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Stops the server as an operator would (SIGTERM, waiting for it to exit) and starts it
    /// again on the same port and store.
    pub fn restart_gracefully(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let _ = child.wait();
        }
        self.spawn();
    }

    /// Kills the server (SIGKILL); [`restart`](Self::restart) brings it back.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The server's URL (`nats://127.0.0.1:<port>`).
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// A JetStream context on a new connection that reconnects on its own.
    ///
    /// # Panics
    /// When the server cannot be reached.
    pub async fn jetstream(&self) -> jetstream::Context {
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect(self.url())
            .await
            .expect("connect to nats-server");
        jetstream::new(client)
    }

    /// Creates stream `name` of `subjects` on file storage (a duplicate window of two minutes).
    ///
    /// # Panics
    /// When JetStream refuses it.
    pub async fn create_stream(&self, name: &str, subjects: &[&str]) -> stream::Stream {
        self.create_stream_with_window(name, subjects, Duration::from_secs(120))
            .await
    }

    /// As [`create_stream`](Self::create_stream), dropping repeated message ids within `window`.
    ///
    /// # Panics
    /// When JetStream refuses it.
    pub async fn create_stream_with_window(
        &self,
        name: &str,
        subjects: &[&str],
        window: Duration,
    ) -> stream::Stream {
        self.jetstream()
            .await
            .create_stream(stream::Config {
                name: name.to_owned(),
                subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
                duplicate_window: window,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("create stream {name}: {e}"))
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The messages of `stream` in stream order, as (`Nats-Msg-Id`, subject, payload), read with an
/// ordered consumer: as many as the stream holds, at most `expected`. It waits up to 30 s for
/// each (a loaded machine may pause the consumer for seconds), so a short read means the stream
/// holds fewer, not that it was slow.
///
/// # Panics
/// When the stream's state cannot be read or the consumer cannot be made.
pub async fn read_stream(
    stream: &stream::Stream,
    expected: usize,
) -> Vec<(String, String, Vec<u8>)> {
    use futures_util::StreamExt;
    let held = stream
        .get_info()
        .await
        .expect("read the stream's state")
        .state
        .messages;
    let expected = expected.min(usize::try_from(held).unwrap_or(usize::MAX));
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
        .await
        .expect("create an ordered consumer");
    let mut messages = consumer.messages().await.expect("consume the stream");
    let mut read = Vec::new();
    while read.len() < expected {
        match tokio::time::timeout(Duration::from_secs(30), messages.next()).await {
            Ok(Some(Ok(message))) => {
                let id = message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Nats-Msg-Id"))
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default();
                read.push((id, message.subject.to_string(), message.payload.to_vec()));
            }
            Ok(Some(Err(error))) => panic!("reading the stream: {error}"),
            Ok(None) | Err(_) => break,
        }
    }
    read
}
