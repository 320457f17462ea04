//! The `.npy` logits dump loads in numpy with the right shape, dtype and values.

use std::process::Command;

use glm_stream::generate::LogitsDump;

#[test]
fn numpy_reads_the_logits_dump() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("logits.npy");
    let (rows, vocab) = (5usize, 13usize);
    let data: Vec<f32> = (0..rows * vocab).map(|i| i as f32 * 0.25 - 3.0).collect();
    LogitsDump { vocab, data }.write_npy(&path).expect("write");
    let script = "import sys, numpy as np\n\
                  a = np.load(sys.argv[1])\n\
                  assert a.dtype == np.float32 and a.flags['C_CONTIGUOUS'], a.dtype\n\
                  ref = (np.arange(a.size, dtype=np.float32) * 0.25 - 3.0).reshape(5, 13)\n\
                  assert np.array_equal(a, ref)\n\
                  print(a.shape)";
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(&path)
        .output()
        .expect("python3 with numpy is required");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "(5, 13)");
}
