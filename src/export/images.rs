//! Which image each role's container runs, and what the person applying the manifests must
//! know about it.
//!
//! Every default names a published version: vLLM's own image of the planned vLLM version
//! (its CPU image for `device = "cpu"`), etcd's official image at a pinned release, LMCache's
//! image for the LMCache server, and the image the repository's `Dockerfile` builds for pdctl
//! (proxy, simulated engines) and `mooncake_master`. An image given on the command line is
//! the user's: pdctl cannot vouch for what it holds, so the header names it.

use super::ExportError;
use crate::plan::Plan;
use crate::topology::{Device, Topology};
use crate::vocab::Role;
use crate::vocab::VersionSource;

/// The image `docker build -t pdctl:<version> .` makes from the repository's `Dockerfile`:
/// pdctl on its PATH, and `mooncake_master` from PyPI.
pub const DEFAULT_PDCTL_IMAGE: &str = concat!("pdctl:", env!("CARGO_PKG_VERSION"));

/// etcd's official image, at the release pdctl's tests run etcd 3.5 against.
pub const DEFAULT_ETCD_IMAGE: &str = "quay.io/coreos/etcd:v3.5.21";

/// LMCache's published image (vLLM with LMCache 0.5.5), which has `python -m lmcache.v1.server`.
pub const DEFAULT_LMCACHE_IMAGE: &str = "lmcache/vllm-openai:v0.5.5";

/// vLLM's image for CUDA GPUs; the tag is `v<vLLM version>`.
pub const VLLM_CUDA_REPOSITORY: &str = "vllm/vllm-openai";

/// vLLM's image of its CPU build (x86_64); the tag is `v<vLLM version>`.
pub const VLLM_CPU_REPOSITORY: &str = "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo";

/// The images given on the command line; `None` takes the default.
#[derive(Debug, Clone, Default)]
pub struct ImageArgs {
    /// `--image`: the vLLM engines' image.
    pub engine: Option<String>,
    /// `--pdctl-image`: pdctl (proxy, simulated engines) and mooncake_master.
    pub pdctl: Option<String>,
    /// `--etcd-image`.
    pub etcd: Option<String>,
    /// `--lmcache-image`: the LMCache server's.
    pub lmcache: Option<String>,
}

/// The image of every role of one export.
#[derive(Debug, Clone)]
pub struct Images {
    /// vLLM engines (None for the simulator, whose engines run the pdctl image).
    engine: Option<String>,
    pdctl: String,
    etcd: String,
    lmcache: String,
}

impl Images {
    /// The image a role's container runs.
    pub fn for_role(&self, role: Role) -> &str {
        match role {
            Role::Etcd => &self.etcd,
            Role::LmcacheServer => &self.lmcache,
            Role::Prefill | Role::Decode => self.engine.as_deref().unwrap_or(&self.pdctl),
            Role::Proxy | Role::MooncakeMaster => &self.pdctl,
        }
    }

    /// The image of pdctl (proxy, simulated engines, mooncake_master).
    pub fn pdctl(&self) -> &str {
        &self.pdctl
    }
}

/// Whether an image reference names no version: no tag (Docker reads `latest`), or `latest`.
pub fn names_no_version(image: &str) -> bool {
    if image.contains('@') {
        return false;
    }
    let last = image.rsplit('/').next().unwrap_or(image);
    match last.split_once(':') {
        None => true,
        Some((_, tag)) => tag == "latest" || tag == "vlatest",
    }
}

/// The image tag of a vLLM version: `v` and the release (`0.10.1.post1+cpu` -> `v0.10.1.post1`,
/// a local build's `+...` has no image of its own).
fn vllm_tag(version: &str) -> String {
    let release = version.split('+').next().unwrap_or(version);
    format!("v{release}")
}

/// Chooses the images of `plan`'s roles; what cannot be vouched for goes to `warnings`.
pub fn choose(
    plan: &Plan,
    topology: &Topology,
    given: &ImageArgs,
    warnings: &mut Vec<String>,
) -> Result<Images, ExportError> {
    let engine = if plan.engine == "sim" {
        None
    } else {
        Some(engine_image(plan, topology, given, warnings)?)
    };
    let pdctl = pdctl_image(plan, given, warnings);
    let etcd = given
        .etcd
        .clone()
        .unwrap_or_else(|| DEFAULT_ETCD_IMAGE.to_string());
    if plan.by_role(Role::Etcd).next().is_some()
        && let Some(image) = &given.etcd
    {
        warnings.push(yours(
            "--etcd-image",
            image,
            "it must have etcd on its PATH",
        ));
    }
    let lmcache = lmcache_image(plan, given, warnings);
    Ok(Images {
        engine,
        pdctl,
        etcd,
        lmcache,
    })
}

/// pdctl's image (`--pdctl-image`, else the default nobody publishes), and what it must
/// hold for the roles it runs.
fn pdctl_image(plan: &Plan, given: &ImageArgs, warnings: &mut Vec<String>) -> String {
    let has_master = plan.by_role(Role::MooncakeMaster).next().is_some();
    let pdctl = given
        .pdctl
        .clone()
        .unwrap_or_else(|| DEFAULT_PDCTL_IMAGE.to_string());
    let mut pdctl_runs = vec!["the proxy"];
    if plan.engine == "sim" {
        pdctl_runs.push("the simulated engines");
    }
    if has_master {
        pdctl_runs.push("mooncake_master");
    }
    match &given.pdctl {
        None => warnings.push(format!(
            "image {pdctl} ({}) is published nowhere: build it from the repository's Dockerfile (`docker build -t {pdctl} .`), push it where the cluster pulls images from, and pass that name with --pdctl-image",
            pdctl_runs.join(", ")
        )),
        Some(image) => warnings.push(yours(
            "--pdctl-image",
            image,
            &format!(
                "it must have pdctl {} on its PATH{}",
                env!("CARGO_PKG_VERSION"),
                if has_master {
                    " and mooncake_master (the Dockerfile installs both)"
                } else {
                    ""
                }
            ),
        )),
    }
    pdctl
}

/// The LMCache server's image. The engines of an LMCache cluster need LMCache in their
/// image too: an engine image the user gives has the server of the engines' own LMCache
/// release.
fn lmcache_image(plan: &Plan, given: &ImageArgs, warnings: &mut Vec<String>) -> String {
    let lmcache = given
        .lmcache
        .clone()
        .or_else(|| given.engine.clone())
        .unwrap_or_else(|| DEFAULT_LMCACHE_IMAGE.to_string());
    let Some(server) = plan.by_role(Role::LmcacheServer).next() else {
        return lmcache;
    };
    let v0_server = server
        .argv
        .first()
        .is_some_and(|p| super::rewrite::program_name(p) == "lmcache_server");
    match (&given.lmcache, &given.engine) {
        (Some(image), _) => warnings.push(yours(
            "--lmcache-image",
            image,
            "it must have the lmcache Python package of the engines' release",
        )),
        (None, Some(image)) => warnings.push(format!(
            "the LMCache server runs the engines' image {image} (--image), which must have LMCache; --lmcache-image gives it another"
        )),
        (None, None) => warnings.push(format!(
            "the LMCache server runs LMCache's image {lmcache} (LMCache 0.5.5); the engines need the same LMCache release in their image (--image), or give the server the engines' release with --lmcache-image{}",
            if v0_server {
                "; this plan's vLLM uses LMCache's V0 server (`lmcache_server`), from LMCache releases before that image's"
            } else {
                ""
            }
        )),
    }
    lmcache
}

/// The vLLM engines' image: `--image`, else vLLM's image of the planned version.
fn engine_image(
    plan: &Plan,
    topology: &Topology,
    given: &ImageArgs,
    warnings: &mut Vec<String>,
) -> Result<String, ExportError> {
    let version = plan.vllm_version.as_deref();
    if let Some(image) = &given.engine {
        warnings.push(yours(
            "--image",
            image,
            &format!(
                "it must have vLLM {} (the version the commands are planned for) and python3 on its PATH",
                version.unwrap_or("of the plan")
            ),
        ));
        return Ok(image.clone());
    }
    let Some(version) = version else {
        return Err(ExportError(
            "the plan names no vLLM version, so no vLLM image can be chosen: pin engine.vllm_version or pass --image".into(),
        ));
    };
    let cpu = topology.engine.device == Device::Cpu;
    let repository = if cpu {
        VLLM_CPU_REPOSITORY
    } else {
        VLLM_CUDA_REPOSITORY
    };
    let tag = vllm_tag(version);
    let image = format!("{repository}:{tag}");
    if plan.vllm_version_source == Some(VersionSource::Assumed) {
        warnings.push(format!(
            "image {image}: vLLM {version} is ASSUMED (no vLLM answered on this machine), and the engines' image follows it: pin engine.vllm_version to the vLLM you mean to run, or pass --image"
        ));
    }
    if tag != format!("v{version}") {
        warnings.push(format!(
            "vLLM {version} is a local build, which has no published image: the engines run {image}, its release; pass --image for your build"
        ));
    }
    if cpu {
        warnings.push(format!(
            "device = \"cpu\": the engines run vLLM's CPU image {image} (x86_64; no GPU requested); pass --image for another CPU build"
        ));
    }
    Ok(image)
}

/// The warning for an image the user gave: pdctl cannot vouch for it.
fn yours(flag: &str, image: &str, needs: &str) -> String {
    let unversioned = if names_no_version(image) {
        " It names no version, so what runs changes with the registry's `latest`."
    } else {
        ""
    };
    format!("{flag} {image} is your image, which pdctl cannot vouch for: {needs}.{unversioned}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_is_a_tag_and_latest_is_no_version() {
        assert_eq!(vllm_tag("0.32.0"), "v0.32.0");
        assert_eq!(vllm_tag("0.10.1.post1+cpu"), "v0.10.1.post1");
        assert!(names_no_version("vllm/vllm-openai"));
        assert!(names_no_version("vllm/vllm-openai:latest"));
        assert!(names_no_version("localhost:5000/pdctl"));
        assert!(!names_no_version("localhost:5000/pdctl:0.1.0"));
        assert!(!names_no_version("pdctl@sha256:00"));
        assert!(!names_no_version(DEFAULT_ETCD_IMAGE));
    }
}
