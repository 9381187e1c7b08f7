//! Two machines on one: network namespaces joined by a veth pair, each with its own
//! network stack, for tests of a cluster over two nodes. Needs root and `ip`; where
//! either is missing [`NetnsPair::create`] says why and the test falls back to loopback
//! addresses.
#![allow(dead_code)]

use std::process::Command;

/// Two namespaces `<tag>-a` and `<tag>-b` joined by a veth pair, with addresses `a` and
/// `b`; deleted (with the pair) when dropped.
pub struct NetnsPair {
    pub a: String,
    pub b: String,
    pub addr_a: String,
    pub addr_b: String,
    veth: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl NetnsPair {
    /// The pair, or why it cannot be made here.
    pub fn create(tag: &str) -> Result<NetnsPair, String> {
        if std::env::var_os("PDCTL_TEST_NO_NETNS").is_some() {
            return Err("PDCTL_TEST_NO_NETNS is set".into());
        }
        // One test binary runs many tests at once: the process id keeps apart the runs of
        // several binaries (other checkouts' tests), the counter the pairs of one.
        static MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let made = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = (std::process::id() + made) % 250;
        let pair = NetnsPair {
            a: format!("{tag}{id}a"),
            b: format!("{tag}{id}b"),
            addr_a: format!("10.231.{id}.1"),
            addr_b: format!("10.231.{id}.2"),
            veth: format!("v{tag}{id}"),
        };
        let _ = ip(&["netns", "del", &pair.a]);
        let _ = ip(&["netns", "del", &pair.b]);
        ip(&["netns", "add", &pair.a])?;
        ip(&["netns", "add", &pair.b])?;
        let (va, vb) = (format!("{}a", pair.veth), format!("{}b", pair.veth));
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        ip(&["link", "set", &va, "netns", &pair.a])?;
        ip(&["link", "set", &vb, "netns", &pair.b])?;
        for (ns, dev, addr) in [(&pair.a, &va, &pair.addr_a), (&pair.b, &vb, &pair.addr_b)] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }

    /// `cmd` run inside namespace `ns` (`ip netns exec`).
    pub fn exec(ns: &str, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).arg(program);
        c
    }

    /// `plain` (a command and its arguments and environment) run inside namespace `ns`,
    /// or as it is where `ns` is None.
    pub fn wrap(ns: Option<&str>, plain: Command) -> Command {
        let Some(ns) = ns else { return plain };
        let mut c = Self::exec(ns, std::path::Path::new(plain.get_program()));
        c.args(plain.get_args());
        for (k, v) in plain.get_envs() {
            match v {
                Some(v) => c.env(k, v),
                None => c.env_remove(k),
            };
        }
        c
    }

    /// Drops every packet between the two without a word (`on`), as a switch that fails
    /// silently does, or lets them through again. The link stays up, so nothing tells
    /// either side: a byte-limit-0 FIFO on each end's egress (iproute2's `tc`; netem is
    /// not in every kernel).
    pub fn set_silent_drop(&self, on: bool) -> Result<(), String> {
        for (ns, dev) in [
            (&self.a, format!("{}a", self.veth)),
            (&self.b, format!("{}b", self.veth)),
        ] {
            let args: Vec<&str> = if on {
                vec![
                    "-n", ns, "qdisc", "replace", "dev", &dev, "root", "bfifo", "limit", "0",
                ]
            } else {
                vec!["-n", ns, "qdisc", "del", "dev", &dev, "root"]
            };
            let out = Command::new("tc")
                .args(&args)
                .output()
                .map_err(|e| format!("tc {}: {e}", args.join(" ")))?;
            if !out.status.success() {
                return Err(format!(
                    "tc {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        Ok(())
    }

    /// One more address on `a`'s end of the pair (`10.231.<id>.<last>`, same /24), for a
    /// test that needs connections from several addresses; it returns the address.
    pub fn add_address_a(&self, last: u8) -> Result<String, String> {
        let base = self.addr_a.rsplit_once('.').map_or("", |(b, _)| b);
        let addr = format!("{base}.{last}");
        ip(&[
            "-n",
            &self.a,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            &format!("{}a", self.veth),
        ])?;
        Ok(addr)
    }

    /// Takes the link between the two down (`up = false`) or up again.
    pub fn set_link(&self, up: bool) -> Result<(), String> {
        let state = if up { "up" } else { "down" };
        ip(&[
            "-n",
            &self.a,
            "link",
            "set",
            &format!("{}a", self.veth),
            state,
        ])
    }
}

impl Drop for NetnsPair {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}

/// Runs `f` on a thread inside namespace `ns` (as is where None) and returns its result.
pub fn in_netns<T: Send + 'static>(ns: Option<&str>, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = ns.map(|n| format!("/var/run/netns/{n}"));
    std::thread::spawn(move || {
        enter(path.as_deref());
        f()
    })
    .join()
    .unwrap()
}

/// Moves the calling thread into the namespace at `path` (none: stays).
pub fn enter(path: Option<&str>) {
    if let Some(p) = path {
        let file = std::fs::File::open(p).unwrap();
        nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
    }
}

/// Two hosts for a two-node cluster: a namespace pair where one can be made, else two
/// loopback addresses (127.0.0.2 and 127.0.0.3) on this machine's one stack, said on
/// stderr. For tests whose claim holds on either (the cut tests need the pair and fail
/// without it).
pub struct TwoHosts {
    /// Kept so the namespaces live as long as the hosts.
    pub pair: Option<NetnsPair>,
    /// The namespaces to run each host's commands in (None on loopback).
    pub ns_a: Option<String>,
    pub ns_b: Option<String>,
    pub addr_a: String,
    pub addr_b: String,
}

impl TwoHosts {
    /// The pair `<tag>-a`/`<tag>-b`, or loopback addresses when it cannot be made.
    pub fn make(tag: &str) -> TwoHosts {
        let pair = NetnsPair::create(tag)
            .map_err(|why| {
                eprintln!("network namespaces unavailable ({why}): using 127.0.0.2 and 127.0.0.3")
            })
            .ok();
        let (ns_a, ns_b) = match &pair {
            Some(p) => (Some(p.a.clone()), Some(p.b.clone())),
            None => (None, None),
        };
        let (addr_a, addr_b) = match &pair {
            Some(p) => (p.addr_a.clone(), p.addr_b.clone()),
            None => ("127.0.0.2".to_string(), "127.0.0.3".to_string()),
        };
        TwoHosts {
            pair,
            ns_a,
            ns_b,
            addr_a,
            addr_b,
        }
    }
}
