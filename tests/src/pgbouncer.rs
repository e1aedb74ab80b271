//! [`PgBouncer`]: a real pgbouncer in transaction mode in front of the test server, started by
//! the test that needs it and stopped when dropped.

use std::fs;
use std::io::Read;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use inbox_client::PgDatabase;
use tokio_postgres::config::Host;
use tokio_postgres::NoTls;

use crate::TestDb;

/// The database name clients give pgbouncer; it maps to the test database.
const ALIAS: &str = "inbox";

/// A pgbouncer process (`pool_mode = transaction`, `auth_type = trust`) listening on a free
/// loopback port, its one database the test database with the [`TestDb`]'s schema on the
/// `search_path` of every server connection; each database/user pair gets at most `pool_size`
/// server connections. Runs as user `postgres` (pgbouncer refuses root), through `-u postgres`
/// when the tests run as root, else through `sudo -n -u postgres`.
///
/// Drop it before the [`TestDb`] (declare it after): its server connections close with it.
#[derive(Debug)]
pub struct PgBouncer {
    child: Child,
    dir: PathBuf,
    port: u16,
    user: String,
    application_name: String,
}

impl PgBouncer {
    /// Starts pgbouncer in front of `db`'s server with at most `pool_size` server connections.
    ///
    /// # Panics
    /// When pgbouncer is not installed (the message says how to install it), or does not start
    /// listening within 10 s (the message holds its log).
    pub fn start(db: &TestDb, pool_size: usize) -> Self {
        let binary = find_binary().unwrap_or_else(|| {
            panic!(
                "pgbouncer is not installed: `apt-get install -y pgbouncer` (scripts/lib.sh's \
                 ensure_toolchain does it); the connection pooler tests need a real one"
            )
        });
        let config = db.config();
        let host = match config.get_hosts().first() {
            Some(Host::Tcp(host)) => host.clone(),
            _ => "127.0.0.1".to_owned(),
        };
        let server_port = config.get_ports().first().copied().unwrap_or(5432);
        let user = config.get_user().unwrap_or("postgres").to_owned();
        let dbname = config.get_dbname().unwrap_or("postgres").to_owned();
        let port = crate::free_port();

        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "inbox-pgbouncer-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("create pgbouncer's directory");
        let userlist = dir.join("userlist.txt");
        fs::write(&userlist, format!("\"{user}\" \"\"\n")).expect("write userlist.txt");
        let ini = dir.join("pgbouncer.ini");
        fs::write(
            &ini,
            format!(
                "[databases]\n\
                 {ALIAS} = host={host} port={server_port} dbname={dbname} user={user} \
                 connect_query='SET search_path = {schema}, public'\n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {port}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {userlist}\n\
                 pool_mode = transaction\n\
                 default_pool_size = {pool_size}\n\
                 min_pool_size = 0\n\
                 reserve_pool_size = 0\n\
                 max_client_conn = 500\n\
                 max_db_connections = {pool_size}\n\
                 ignore_startup_parameters = extra_float_digits\n\
                 server_reset_query =\n\
                 log_connections = 0\n\
                 log_disconnections = 0\n",
                schema = db.schema(),
                userlist = userlist.display(),
            ),
        )
        .expect("write pgbouncer.ini");
        let log = fs::File::create(dir.join("pgbouncer.log")).expect("create pgbouncer.log");
        let mut command = if running_as_root() {
            let mut command = Command::new(&binary);
            command.arg("-u").arg("postgres");
            command
        } else {
            let mut command = Command::new("sudo");
            command.args(["-n", "-u", "postgres"]).arg(&binary);
            command
        };
        let child = command
            .arg(&ini)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone the log's handle"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
        let mut bouncer = Self {
            child,
            dir,
            port,
            user,
            application_name: config
                .get_application_name()
                .unwrap_or("inbox-tests")
                .to_owned(),
        };
        bouncer.wait_until_listening();
        bouncer
    }

    fn wait_until_listening(&mut self) {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("pgbouncer exited ({status}):\n{}", self.log());
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            if started.elapsed() > Duration::from_secs(10) {
                panic!("pgbouncer did not listen within 10 s:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What pgbouncer logged so far.
    pub fn log(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = fs::File::open(self.dir.join("pgbouncer.log")) {
            let _ = file.read_to_string(&mut text);
        }
        text
    }

    /// The port pgbouncer listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Connection settings that reach the test database (and its schema) through pgbouncer.
    pub fn config(&self) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        config
            .host("127.0.0.1")
            .port(self.port)
            .user(&self.user)
            .dbname(ALIAS)
            .application_name(&self.application_name);
        config
    }

    /// A pool of at most `size` client connections to pgbouncer.
    pub fn pool(&self, size: usize) -> Pool {
        let manager = Manager::from_config(
            self.config(),
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        Pool::builder(manager)
            .max_size(size)
            .build()
            .unwrap_or_else(|e| panic!("cannot build a pool: {e}"))
    }

    /// The port through pgbouncer ([`PgDatabase::behind_pooler`]), whose workers LISTEN on a
    /// direct connection to `db`'s server.
    pub fn port_listening_directly(&self, db: &TestDb, size: usize) -> PgDatabase {
        PgDatabase::from_pool(self.pool(size)).behind_pooler(Some(db.config()))
    }

    /// The port through pgbouncer whose workers poll (no direct connection given).
    pub fn port_polling(&self, size: usize) -> PgDatabase {
        PgDatabase::from_pool(self.pool(size)).behind_pooler(None)
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // SIGTERM: pgbouncer closes every connection and exits at once (sudo forwards it).
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The pgbouncer binary on the `PATH` or in `/usr/sbin` (Debian's place, often not on a user's
/// `PATH`).
fn find_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
        .map(|dir| dir.join("pgbouncer"))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}
