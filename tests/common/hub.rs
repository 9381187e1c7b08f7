//! A stand-in Hugging Face hub for tests (tests/hub_server.py, started per test), the tiny
//! model it serves, and the Python with huggingface_hub that fetches from it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The Python with huggingface_hub the fetch runs with: `PDCTL_TEST_HF_PYTHON`, else the
/// system venv's (./install.sh --with-test-deps installs it there, as vLLM does). Panics saying why when it lacks it:
/// these tests need it, they never pass without.
pub fn hf_python() -> String {
    let python = std::env::var("PDCTL_TEST_HF_PYTHON")
        .unwrap_or_else(|_| "/opt/pdctl/venv/bin/python".to_string());
    let ok = Command::new(&python)
        .args(["-c", "import huggingface_hub"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{python} cannot import huggingface_hub: install it (./install.sh --with-test-deps puts it in /opt/pdctl/venv) or set PDCTL_TEST_HF_PYTHON to a Python that has it"
    );
    python
}

/// A stand-in for vLLM's CPU build: `python -m vllm...` serves 200 to every GET at its
/// `--host`/`--port`; the fetch script (`-c SCRIPT list|fetch ...`) runs in the Python with
/// huggingface_hub; a module check answers found, anything else prints version 0.26.0.
pub fn fake_vllm(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let engine = dir.join("fake_vllm.py");
    std::fs::write(
        &engine,
        "import http.server, sys\nargs = sys.argv[1:]\nflag = lambda n: args[args.index(n) + 1]\n\
         class H(http.server.BaseHTTPRequestHandler):\n    def do_GET(self):\n        self.send_response(200)\n        self.send_header('content-length', '2')\n        self.end_headers()\n        self.wfile.write(b'ok')\n    def log_message(self, *a):\n        pass\n\
         print('ready', flush=True)\nhttp.server.HTTPServer((flag('--host'), int(flag('--port'))), H).serve_forever()\n",
    )
    .unwrap();
    let python = dir.join("python3");
    std::fs::write(
        &python,
        format!(
            "#!/bin/sh\nif [ \"$1\" = -m ]; then shift 2; exec python3 {} \"$@\"; fi\n\
             if [ \"$1\" = -c ] && {{ [ \"$3\" = list ] || [ \"$3\" = fetch ]; }}; then exec {} \"$@\"; fi\n\
             if [ \"$1\" = -c ] && [ $# -ge 3 ]; then exit 0; fi\nprintf 0.26.0\n",
            engine.display(),
            hf_python()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    python
}

/// A running hub_server.py, killed when dropped.
pub struct Hub {
    child: Child,
    pub port: u16,
    log: PathBuf,
}

impl Hub {
    /// Serves `repos` (id, directory) with the extra `flags` (`--cut-once`, `--gated T`...).
    pub fn start(dir: &Path, repos: &[(&str, &Path)], flags: &[&str]) -> Hub {
        Hub::start_in(None, dir, repos, flags)
    }

    /// [`Hub::start`] inside network namespace `ns` (its 127.0.0.1 is that namespace's).
    pub fn start_in(ns: Option<&str>, dir: &Path, repos: &[(&str, &Path)], flags: &[&str]) -> Hub {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hub_server.py");
        let port_file = dir.join("hub.port");
        let log = dir.join("hub.log");
        let mut c = Command::new("python3");
        c.arg(&script)
            .arg("--port-file")
            .arg(&port_file)
            .arg("--log")
            .arg(&log);
        for (id, path) in repos {
            c.arg("--repo").arg(format!("{id}={}", path.display()));
        }
        c.args(flags);
        let child = crate::common::netns::NetnsPair::wrap(ns, c)
            .spawn()
            .expect("python3 runs tests/hub_server.py");
        let mut hub = Hub {
            child,
            port: 0,
            log,
        };
        let ready = crate::common::wait_until(Duration::from_secs(20), || {
            std::fs::read_to_string(&port_file).is_ok_and(|p| p.trim().parse::<u16>().is_ok())
        });
        assert!(ready, "tests/hub_server.py did not start");
        hub.port = std::fs::read_to_string(&port_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        hub
    }

    /// Its address, for HF_ENDPOINT.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The requests it answered so far, one JSON value each.
    pub fn requests(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes a tiny model repository into `dir`: a 2 MiB safetensors file (one F32 tensor),
/// a config.json a Qwen2-like model would have, tokenizer and generation config files,
/// and files vLLM does not load (a PyTorch .bin beside the safetensors, a README) that a
/// fetch must leave on the hub.
pub fn tiny_repo(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let n: u64 = 512 * 1024;
    let header = format!(
        r#"{{"__metadata__":{{"format":"pt"}},"w":{{"dtype":"F32","shape":[{n}],"data_offsets":[0,{}]}}}}"#,
        4 * n
    );
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend((0..4 * n).map(|i| (i * 7 % 251) as u8));
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "hidden_size": 896, "max_position_embeddings": 32768,
            "torch_dtype": "bfloat16", "vocab_size": 151936}"#,
    )
    .unwrap();
    std::fs::write(dir.join("tokenizer.json"), r#"{"version": "1.0"}"#).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), "{}").unwrap();
    std::fs::write(dir.join("generation_config.json"), "{}").unwrap();
    std::fs::write(dir.join("pytorch_model.bin"), vec![1u8; 4096]).unwrap();
    std::fs::write(dir.join("README.md"), "# tiny\n").unwrap();
}
