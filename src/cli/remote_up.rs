//! `pdctl up` on the head starting the other nodes over SSH: for each node whose
//! `[nodes]` table says `ssh`, the system's OpenSSH client (the user's keys, agent and
//! ~/.ssh/config; `PDCTL_SSH_COMMAND` replaces program and options, as GIT_SSH_COMMAND
//! does for git) checks the node has this very pdctl (by its SHA-256) and copies it there
//! when not (same architecture only), then runs the hidden `pdctl node-up` there, which
//! takes the plan, the node's certificate and key and the engines' key on its standard
//! input (never an argument, an environment variable or a log line) and does what `pdctl
//! up -d --node NODE` would. The cluster's secret stays on the head: a node started this
//! way cannot join as another node.

use crate::control::auth::EngineKey;
use crate::control::tls::{ClusterCa, NodeCreds};
use crate::plan::Plan;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{BufRead, Read, Write};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The environment variable that replaces `ssh` and its options (run by `sh -c`, the
/// destination and the remote command appended).
pub const SSH_COMMAND_ENV: &str = "PDCTL_SSH_COMMAND";

/// Where pdctl is put on a node, under the SSH user's home: one folder per SHA-256,
/// `~/.pdctl/bin/<sha256>/pdctl`, so a binary is only ever found under the hash it was
/// checked to have.
const REMOTE_ROOT: &str = ".pdctl/bin";

/// `word` as one word of the node's shell, quoted where it needs it.
fn sh_word(word: &str) -> anyhow::Result<String> {
    shlex::try_quote(word)
        .map(|w| w.into_owned())
        .map_err(|e| anyhow::anyhow!("`{}` cannot be given to a shell: {e}", word.escape_debug()))
}

/// `rest` under the SSH user's home, as one word the node's shell expands `$HOME` in.
fn in_home(rest: &str) -> anyhow::Result<String> {
    Ok(format!("\"$HOME\"/{}", sh_word(rest)?))
}

/// The folder of the binary whose SHA-256 is `hash`, as the node's shell reads it.
fn remote_dir(hash: &str) -> anyhow::Result<String> {
    in_home(&format!("{REMOTE_ROOT}/{hash}"))
}

/// The binary whose SHA-256 is `hash`, as the node's shell reads it.
fn remote_bin(hash: &str) -> anyhow::Result<String> {
    in_home(&format!("{REMOTE_ROOT}/{hash}/pdctl"))
}

/// Everything a node started over SSH is handed on its standard input. No `Debug`: it
/// holds the node's key and the engines' key.
#[derive(Serialize, Deserialize)]
pub struct NodeBundle {
    pub node: String,
    pub plan: Plan,
    /// The key every engine of the cluster requires (the head's, derived or set).
    pub engine_key: String,
    /// The proxy's client key (`PDCTL_API_KEY` of the head's `up`), when set: a proxy on
    /// this node requires it as the head's would.
    #[serde(default)]
    pub client_key: Option<String>,
    pub creds: NodeCreds,
    pub log_max_bytes: u64,
    pub log_keep: u32,
    /// The values of the secret variables the plan names only (hub tokens), which the
    /// node keeps in its state dir (mode 0600) for its engines.
    #[serde(default)]
    pub hidden_env: crate::vocab::HiddenEnv,
}

/// The largest bundle `node-up` reads (a plan with its files is far smaller).
pub const BUNDLE_MAX: u64 = 64 << 20;

/// `ssh -- DEST REMOTE`, or the user's `PDCTL_SSH_COMMAND` in its place (`--` and the
/// destination appended to it): `--` ends ssh's options, so no destination is read as one
/// (`plan` refuses a destination beginning with `-` besides).
fn ssh(dest: &str, remote: &str) -> Command {
    match std::env::var(SSH_COMMAND_ENV) {
        Ok(cmd) if !cmd.trim().is_empty() => {
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg(format!("{cmd} -- \"$@\""))
                .arg("pdctl-ssh")
                .args([dest, remote]);
            c
        }
        _ => {
            let mut c = Command::new("ssh");
            c.args([
                "-o",
                "BatchMode=yes",
                "-o",
                "ConnectTimeout=10",
                "--",
                dest,
                remote,
            ]);
            c
        }
    }
}

/// Runs `cmd` with `input` on its stdin; its stdout, or an error with its stderr.
fn run(mut cmd: Command, input: Option<&mut dyn Read>, what: &str) -> anyhow::Result<String> {
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| {
        anyhow::anyhow!(
            "{what}: cannot run ssh: {e} (install the OpenSSH client, or set {SSH_COMMAND_ENV})"
        )
    })?;
    if let Some(input) = input {
        let mut stdin = child.stdin.take().expect("piped");
        std::io::copy(input, &mut stdin).map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        anyhow::bail!(
            "{what}: ssh exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// SHA-256 of this pdctl binary (hex).
fn own_hash() -> anyhow::Result<(std::path::PathBuf, String)> {
    use sha2::Digest;
    let exe = std::env::current_exe()?;
    let mut f = std::fs::File::open(&exe)?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    let hex = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((exe, hex))
}

/// Makes sure `dest` has this pdctl; the command that runs it there. The node hashes
/// the binary it has under this hash's folder (a stamp file could lie); a copy goes to a
/// temporary name of its own (`mktemp`), is hashed there on the node and only then
/// moved into `~/.pdctl/bin/<sha256>/pdctl`.
fn ensure_pdctl(
    node: &str,
    dest: &str,
    exe: &std::path::Path,
    hash: &str,
) -> anyhow::Result<(String, &'static str)> {
    let (dir, bin) = (remote_dir(hash)?, remote_bin(hash)?);
    let probe = format!(
        "uname -m; sha256sum {bin} 2>/dev/null | cut -c1-64 | grep . || echo none; pdctl --version 2>/dev/null || echo none"
    );
    let what = format!("node {node} ({dest})");
    let out = run(ssh(dest, &probe), None, &what)?;
    let mut lines = out.lines().map(str::trim);
    let arch = lines.next().unwrap_or_default().to_string();
    let there = lines.next().unwrap_or_default();
    let on_path = lines.next().unwrap_or_default();
    if there == hash {
        return Ok((bin, "already there"));
    }
    let ours = std::env::consts::ARCH;
    if arch != ours {
        let version = concat!("pdctl ", env!("CARGO_PKG_VERSION"));
        if on_path == version {
            return Ok(("pdctl".to_string(), "on its PATH"));
        }
        anyhow::bail!(
            "{what} is {arch} and this pdctl is built for {ours}: install {version} there (./install.sh on that machine) so `pdctl` is on its PATH, then `pdctl up` again"
        );
    }
    let copy = format!(
        "umask 077 && mkdir -p {dir} && t=$(mktemp {dir}/.pdctl.XXXXXXXX) && \
         {{ cat > \"$t\" && chmod 700 \"$t\" && h=$(sha256sum \"$t\" | cut -c1-64) && \
         if [ \"$h\" = {quoted} ]; then mv -f \"$t\" {bin}; else echo \"the copy has SHA-256 $h, not \"{quoted} >&2; false; fi; }} \
         || {{ rm -f \"$t\"; exit 1; }}",
        quoted = sh_word(hash)?
    );
    let mut file = std::fs::File::open(exe)?;
    run(
        ssh(dest, &copy),
        Some(&mut file),
        &format!("copying pdctl to {what}"),
    )?;
    Ok((bin, "copied"))
}

/// One node being started over SSH: its `node-up`'s output and, once it ended, how.
struct Started {
    node: String,
    dest: String,
    /// The pdctl that runs there, as one word of its shell (for `pdctl down` there when
    /// `up` fails).
    program: String,
    output: Arc<Mutex<Vec<String>>>,
    exit: Arc<Mutex<Option<ExitStatus>>>,
}

/// The nodes the head started over SSH, their `node-up`s running in the background.
#[derive(Default)]
pub struct RemoteNodes {
    started: Vec<Started>,
}

/// What each SSH node is given, made by the head.
pub struct Handout<'a> {
    pub plan: &'a Plan,
    /// The head's state dir, where a node's fetch progress is kept for `status`.
    pub state_dir: &'a std::path::Path,
    pub ca: &'a ClusterCa,
    pub engine_key: &'a EngineKey,
    pub client_key: Option<&'a crate::control::auth::ClientKey>,
    pub log_max_bytes: u64,
    pub log_keep: u32,
    /// The values of the plan's secret variables (hub tokens) the nodes' engines need.
    pub hidden_env: &'a crate::vocab::HiddenEnv,
}

impl RemoteNodes {
    /// For every node with `ssh` (but the head): pdctl put there, then its `node-up`
    /// started. Fails, before anything runs anywhere, when a node cannot be reached or
    /// given pdctl.
    pub fn start(ssh_of: &BTreeMap<String, String>, h: &Handout) -> anyhow::Result<RemoteNodes> {
        let targets: Vec<(&String, &String)> = ssh_of
            .iter()
            .filter(|(n, _)| **n != h.plan.head_node && h.plan.nodes.contains_key(*n))
            .collect();
        if targets.is_empty() {
            return Ok(RemoteNodes::default());
        }
        let (exe, hash) = own_hash()?;
        let ready: Vec<anyhow::Result<String>> = std::thread::scope(|s| {
            let jobs: Vec<_> = targets
                .iter()
                .map(|(node, dest)| {
                    let (exe, hash) = (&exe, &hash);
                    s.spawn(move || {
                        let t0 = Instant::now();
                        let (program, how) = ensure_pdctl(node, dest, exe, hash)?;
                        println!(
                            "pdctl: node {node} ({dest}): pdctl {how} ({:.1} s)",
                            t0.elapsed().as_secs_f64()
                        );
                        Ok(program)
                    })
                })
                .collect();
            jobs.into_iter()
                .map(|j| {
                    j.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("a thread panicked")))
                })
                .collect()
        });
        let mut nodes = RemoteNodes::default();
        for ((node, dest), program) in targets.into_iter().zip(ready) {
            let program = program?;
            nodes.started.push(start_one(node, dest, &program, h)?);
        }
        Ok(nodes)
    }

    /// Whether the head started any node.
    pub fn is_empty(&self) -> bool {
        self.started.is_empty()
    }

    /// The first node whose `node-up` failed, with the end of what it said.
    pub fn failure(&self) -> Option<String> {
        self.started.iter().find_map(|s| {
            let status = (*s.exit.lock().unwrap_or_else(|e| e.into_inner()))?;
            if status.success() {
                return None;
            }
            let out = s.output.lock().unwrap_or_else(|e| e.into_inner());
            let tail = out[out.len().saturating_sub(20)..].join("\n    ");
            Some(format!(
                "node {} ({}): `pdctl up` there failed ({status}):\n    {tail}",
                s.node, s.dest
            ))
        })
    }

    /// A failed `up` takes down what it started: waits (up to `limit`) for each node's
    /// `node-up` to end, then runs `pdctl down` there over ssh (the node's cluster dir
    /// named, so nothing else there is touched). One line per node, saying how it went.
    pub fn take_down(&self, plan: &Plan, limit: Duration) -> Vec<String> {
        let end = Instant::now() + limit;
        let mut lines = Vec::new();
        for s in &self.started {
            while s.exit.lock().unwrap_or_else(|e| e.into_inner()).is_none() && Instant::now() < end
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            let dir = crate::plan::build::state_dir_of(
                &plan.cluster,
                true,
                std::path::Path::new("/"),
                &s.node,
            );
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let what = format!("node {} ({})", s.node, s.dest);
            let ran = sh_word(&name).and_then(|name| {
                run(
                    ssh(&s.dest, &format!("{} down --cluster {name}", s.program)),
                    None,
                    &what,
                )
            });
            lines.push(match ran {
                Ok(out) => format!(
                    "{what}: taken down ({})",
                    out.lines().last().unwrap_or("done").trim()
                ),
                Err(e) if e.to_string().contains("exit status: 3") => {
                    format!("{what}: nothing of cluster {} runs there", plan.cluster)
                }
                Err(e) => format!("{what}: could not take it down: {e:#}"),
            });
        }
        lines
    }

    /// Waits (up to `limit`) for every `node-up` to end and says how each did.
    pub fn finish(&self, limit: Duration) {
        let end = Instant::now() + limit;
        for s in &self.started {
            while s.exit.lock().unwrap_or_else(|e| e.into_inner()).is_none() && Instant::now() < end
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            let status = *s.exit.lock().unwrap_or_else(|e| e.into_inner());
            let out = s.output.lock().unwrap_or_else(|e| e.into_inner());
            match status {
                Some(st) if st.success() => println!(
                    "pdctl: node {} ({}): {}",
                    s.node,
                    s.dest,
                    out.last().map(String::as_str).unwrap_or("up")
                ),
                Some(_) => eprintln!("error: {}", self.failure().unwrap_or_default()),
                None => eprintln!(
                    "pdctl: node {} ({}): `pdctl up` there has not finished; its last words: {}",
                    s.node,
                    s.dest,
                    out.last().map(String::as_str).unwrap_or("none")
                ),
            }
        }
    }
}

/// Starts `node-up` on one node, its bundle written to its stdin, its output collected.
fn start_one(node: &str, dest: &str, program: &str, h: &Handout) -> anyhow::Result<Started> {
    let bundle = NodeBundle {
        node: node.to_string(),
        plan: h.plan.clone(),
        engine_key: h.engine_key.reveal().to_string(),
        client_key: h.client_key.map(|k| k.reveal().to_string()),
        creds: h.ca.issue(node, "ssh")?,
        log_max_bytes: h.log_max_bytes,
        log_keep: h.log_keep,
        hidden_env: h.hidden_env.clone(),
    };
    let mut cmd = ssh(dest, &format!("{program} node-up"));
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| anyhow::anyhow!("node {node} ({dest}): cannot run ssh: {e}"))?;
    let mut stdin = child.stdin.take().expect("piped");
    let json = serde_json::to_vec(&bundle).expect("bundles serialize");
    stdin
        .write_all(&json)
        .map_err(|e| anyhow::anyhow!("node {node} ({dest}): handing it its credentials: {e}"))?;
    drop(stdin);
    let output = Arc::new(Mutex::new(Vec::new()));
    let exit = Arc::new(Mutex::new(None));
    let readers: Vec<_> = [
        child
            .stdout
            .take()
            .map(|o| Box::new(o) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|e| Box::new(e) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    .map(|r| {
        let kept = h.state_dir.join(super::pull::node_fetch_file(node));
        relay(node.to_string(), r, output.clone(), kept)
    })
    .collect();
    let done = exit.clone();
    let kept = h.state_dir.join(super::pull::node_fetch_file(node));
    std::thread::spawn(move || {
        for r in readers {
            let _ = r.join();
        }
        // A fetch that ended without its last line (the node's `up` failed) is over too.
        let _ = std::fs::remove_file(&kept);
        let status = child.wait().ok();
        *done.lock().unwrap_or_else(|e| e.into_inner()) = status;
    });
    println!("pdctl: node {node} ({dest}): starting its supervisor over ssh");
    Ok(Started {
        node: node.to_string(),
        dest: dest.to_string(),
        program: program.to_string(),
        output,
        exit,
    })
}

/// Reads one of `node`'s `node-up` outputs line by line on a thread of its own: the
/// node's model fetch shown as it goes (it can take minutes) and its state kept in
/// `kept` for the head's `status` while this process relays it; every other line kept
/// in `output`.
fn relay(
    node: String,
    r: Box<dyn Read + Send>,
    output: Arc<Mutex<Vec<String>>>,
    kept: std::path::PathBuf,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(r).lines().map_while(Result::ok) {
            let line = crate::supervisor::strip_ansi(&line);
            if let Some(json) = line.strip_prefix(super::pull::TO_HEAD_PREFIX) {
                if let Ok(mut state) = serde_json::from_str::<super::pull::FetchState>(json) {
                    state.pid = std::process::id();
                    let json = serde_json::to_vec(&state).expect("fetch states serialize");
                    let _ = crate::supervisor::write_atomic(&kept, &json);
                }
                continue;
            }
            if let Some(fetch) = line.strip_prefix("pdctl: fetch") {
                println!("pdctl: node {node}: fetch{fetch}");
                if fetch.starts_with("ed ") {
                    let _ = std::fs::remove_file(&kept);
                }
            }
            if !line.trim().is_empty() {
                output.lock().unwrap_or_else(|e| e.into_inner()).push(line);
            }
        }
    })
}

/// Reads the bundle `node-up` is handed on its stdin.
pub fn read_bundle(input: impl Read) -> anyhow::Result<NodeBundle> {
    let mut text = Vec::new();
    input.take(BUNDLE_MAX).read_to_end(&mut text)?;
    serde_json::from_slice(&text).map_err(|e| {
        anyhow::anyhow!(
            "node-up reads what `pdctl up` on the head hands it over ssh, not this ({e})"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `sh` makes of `words`, each printed on a line of its own.
    fn sh_reads(words: &str, home: &str) -> String {
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("printf '%s\\n' {words}"))
            .env("HOME", home)
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn words_reach_the_nodes_shell_as_they_were_written() {
        for word in [
            "plain-name_1.x",
            "two words",
            "it's",
            "$HOME",
            "a\"b`c`",
            "*",
        ] {
            assert_eq!(sh_reads(&sh_word(word).unwrap(), "/h"), format!("{word}\n"));
        }
        assert!(sh_word("nul\0").is_err());
    }

    #[test]
    fn the_binary_lies_under_the_home_of_the_ssh_user() {
        let hash = "ab".repeat(32);
        assert_eq!(
            sh_reads(&remote_bin(&hash).unwrap(), "/home/a b"),
            format!("/home/a b/.pdctl/bin/{hash}/pdctl\n")
        );
        assert_eq!(
            sh_reads(&remote_dir(&hash).unwrap(), "/h"),
            format!("/h/.pdctl/bin/{hash}\n")
        );
    }
}
