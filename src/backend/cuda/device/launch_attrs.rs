//! The attributes of a `cuLaunchKernelEx` call for each way a kernel is launched: clusters,
//! programmatic dependence, or both at once (a cluster launch used to drop the dependence, so
//! the pair-merging decodes waited for the whole kernel before them).

use super::LaunchMode;
use cudarc::driver::sys::{CUlaunchAttribute, CUlaunchAttributeID};

/// The attributes of a launch in `mode` and how many of the two are set (0 for a plain one).
pub(super) fn of(mode: LaunchMode) -> ([CUlaunchAttribute; 2], u32) {
    // SAFETY: zero is a valid bit pattern for the attributes (C structs and unions).
    let mut attrs: [CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
    let mut n = 0;
    if let LaunchMode::Cluster(size, _) = mode {
        let cluster = &mut attrs[n];
        cluster.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        cluster.value.clusterDim.x = size;
        cluster.value.clusterDim.y = 1;
        cluster.value.clusterDim.z = 1;
        n += 1;
    }
    if matches!(mode, LaunchMode::Dependent | LaunchMode::Cluster(_, true)) {
        let dependent = &mut attrs[n];
        dependent.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        dependent.value.programmaticStreamSerializationAllowed = 1;
        n += 1;
    }
    (attrs, n as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What each mode asks of the driver: (cluster size, dependent), read back from the
    /// attributes as the driver would.
    fn asked(mode: LaunchMode) -> (Option<u32>, bool) {
        let (attrs, n) = of(mode);
        let mut cluster = None;
        let mut dependent = false;
        for a in &attrs[..n as usize] {
            match a.id {
                CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION => {
                    // SAFETY: the id says which member of the union was written.
                    let dim = unsafe { a.value.clusterDim };
                    assert_eq!((dim.y, dim.z), (1, 1));
                    cluster = Some(dim.x);
                }
                CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION => {
                    // SAFETY: as above.
                    dependent = unsafe { a.value.programmaticStreamSerializationAllowed } == 1;
                }
                other => panic!("unexpected attribute {other:?}"),
            }
        }
        (cluster, dependent)
    }

    #[test]
    fn a_cluster_launch_can_be_a_dependent_too() {
        assert_eq!(of(LaunchMode::Plain).1, 0);
        assert_eq!(asked(LaunchMode::Dependent), (None, true));
        assert_eq!(asked(LaunchMode::Cluster(2, false)), (Some(2), false));
        // Before, a cluster launch set only its dimension: the pairs were never dependents.
        assert_eq!(asked(LaunchMode::Cluster(2, true)), (Some(2), true));
    }
}
