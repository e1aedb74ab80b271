//! A TCP proxy between a test's clients and PostgreSQL that can misbehave on purpose: freeze its
//! connections (stop forwarding without closing, a half-open connection), cut a connection right
//! after forwarding a `COMMIT` (the commit takes, its result never arrives), or hold a `BEGIN`
//! back for a while.
//!
//! It reads the client's side of the protocol just enough to find simple-query messages: the
//! startup packet (and an SSL request before it) has no type byte, every later message is a type
//! byte and a length.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

#[derive(Default)]
struct State {
    /// Cut every n-th COMMIT after forwarding it (0: never).
    cut_every: AtomicU64,
    commits: AtomicU64,
    cuts: AtomicU64,
    /// How long to hold each BEGIN back, in milliseconds (0: not at all).
    begin_delay_ms: AtomicU64,
    begins_delayed: AtomicU64,
    connections: Mutex<Vec<Arc<Link>>>,
}

/// One proxied connection.
struct Link {
    frozen: AtomicBool,
    /// Set when the link is being cut: nothing more is forwarded to the client.
    cutting: AtomicBool,
    closed: CancellationToken,
}

pub struct Proxy {
    pub port: u16,
    state: Arc<State>,
    stop: CancellationToken,
}

impl Proxy {
    /// Listens on a free loopback port and forwards each connection to `target`.
    pub async fn start(target: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let state = Arc::new(State::default());
        let stop = CancellationToken::new();
        let (accept_state, accept_stop) = (state.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    accepted = listener.accept() => accepted,
                    _ = accept_stop.cancelled() => return,
                };
                let Ok((client, _)) = accepted else { continue };
                let (state, stop) = (accept_state.clone(), accept_stop.clone());
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(target).await {
                        link(state, stop, client, server).await;
                    }
                });
            }
        });
        Ok(Self { port, state, stop })
    }

    /// Stops forwarding on every connection open now, in both directions, keeping them open;
    /// returns how many were frozen. Later connections are forwarded as usual.
    pub fn freeze_all(&self) -> usize {
        let links = self.state.connections.lock().expect("proxy links");
        let live: Vec<_> = links.iter().filter(|l| !l.closed.is_cancelled()).collect();
        for link in &live {
            link.frozen.store(true, Ordering::SeqCst);
        }
        live.len()
    }

    /// Cuts every `n`-th COMMIT's connection right after forwarding it (0: never again).
    pub fn cut_every_nth_commit(&self, n: u64) {
        self.state.cut_every.store(n, Ordering::SeqCst);
    }

    pub fn cuts(&self) -> u64 {
        self.state.cuts.load(Ordering::SeqCst)
    }

    /// Holds every later BEGIN back for `delay` before forwarding it.
    pub fn delay_begin(&self, delay: Duration) {
        self.state
            .begin_delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    pub fn begins_delayed(&self) -> u64 {
        self.state.begins_delayed.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    /// Closes the listener and every connection, frozen ones included.
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn link(state: Arc<State>, stop: CancellationToken, client: TcpStream, server: TcpStream) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let link = Arc::new(Link {
        frozen: AtomicBool::new(false),
        cutting: AtomicBool::new(false),
        closed: stop.child_token(),
    });
    state
        .connections
        .lock()
        .expect("proxy links")
        .push(link.clone());
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let back = tokio::spawn(server_to_client(link.clone(), server_read, client_write));
    let closed = link.closed.clone();
    tokio::select! {
        _ = client_to_server(&state, &link, client_read, server_write) => {}
        _ = closed.cancelled() => {}
    }
    link.closed.cancel();
    let _ = back.await;
}

/// Waits while the link is frozen (for good: a frozen link only ends when the proxy does).
async fn hold_if_frozen(link: &Link) {
    if link.frozen.load(Ordering::SeqCst) {
        link.closed.cancelled().await;
    }
}

async fn server_to_client(link: Arc<Link>, mut from: OwnedReadHalf, mut to: OwnedWriteHalf) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let read = tokio::select! {
            read = from.read(&mut buffer) => read,
            _ = link.closed.cancelled() => return,
        };
        let Ok(n) = read else { break };
        if n == 0 {
            break;
        }
        hold_if_frozen(&link).await;
        if link.cutting.load(Ordering::SeqCst) || link.closed.is_cancelled() {
            return;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            break;
        }
    }
    link.closed.cancel();
}

/// Forwards the client's messages one at a time, acting on the simple queries it is told to.
async fn client_to_server(
    state: &State,
    link: &Link,
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
) -> std::io::Result<()> {
    // The startup packet, preceded by an SSL or GSS request that the server answers with one byte.
    loop {
        let length = from.read_u32().await?;
        let mut body = vec![0u8; length.saturating_sub(4) as usize];
        from.read_exact(&mut body).await?;
        hold_if_frozen(link).await;
        to.write_all(&length.to_be_bytes()).await?;
        to.write_all(&body).await?;
        let code = body
            .get(..4)
            .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
        if !matches!(code, Some(80_877_103 | 80_877_104)) {
            break;
        }
    }
    loop {
        let kind = from.read_u8().await?;
        let length = from.read_u32().await?;
        let mut body = vec![0u8; length.saturating_sub(4) as usize];
        from.read_exact(&mut body).await?;
        hold_if_frozen(link).await;
        let query = (kind == b'Q').then(|| body.strip_suffix(&[0]).unwrap_or(&body));
        // The message's first command: a worker sends `COMMIT; BEGIN; SET LOCAL ...` as one.
        let is = |word: &[u8]| {
            query.is_some_and(|q| {
                q.len() >= word.len()
                    && q[..word.len()].eq_ignore_ascii_case(word)
                    && q.get(word.len())
                        .is_none_or(|&c| c == b';' || c.is_ascii_whitespace())
            })
        };
        if is(b"BEGIN") {
            let delay = state.begin_delay_ms.load(Ordering::SeqCst);
            if delay > 0 {
                state.begins_delayed.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
        }
        let mut cut = false;
        if is(b"COMMIT") {
            let every = state.cut_every.load(Ordering::SeqCst);
            let count = state.commits.fetch_add(1, Ordering::SeqCst) + 1;
            if every > 0 && count.is_multiple_of(every) {
                // Nothing the server sends from here on reaches the client.
                link.cutting.store(true, Ordering::SeqCst);
                cut = true;
            }
        }
        let mut message = Vec::with_capacity(body.len() + 5);
        message.push(kind);
        message.extend_from_slice(&length.to_be_bytes());
        message.extend_from_slice(&body);
        to.write_all(&message).await?;
        if cut {
            to.flush().await?;
            // The server has the COMMIT; let it run before its connection closes.
            tokio::time::sleep(Duration::from_millis(100)).await;
            state.cuts.fetch_add(1, Ordering::SeqCst);
            return Ok(());
        }
    }
}
