//! In-place writes into MLX-owned memory: the basis of expert slots.

use glm_stream::mlx::{self, Dtype, MlxError, WritableBuffer};

fn write_f32(buf: &mut WritableBuffer, offset: usize, vals: &[f32]) {
    let bytes = buf.bytes_mut().expect("exclusive");
    for (i, v) in vals.iter().enumerate() {
        bytes[offset + 4 * i..offset + 4 * i + 4].copy_from_slice(&v.to_le_bytes());
    }
}

#[test]
fn writes_are_seen_by_later_computations() {
    let mut buf = WritableBuffer::new(64).unwrap();
    assert_eq!(buf.len(), 64);
    assert!(
        buf.bytes_mut().unwrap().iter().all(|&b| b == 0),
        "starts zeroed"
    );
    write_f32(&mut buf, 0, &[1.0, 2.0, 3.0, 4.0]);
    let sum1 = buf
        .view(0, &[2, 2], Dtype::Float32)
        .unwrap()
        .sum(&[], false)
        .unwrap();
    assert_eq!(sum1.item::<f32>().unwrap(), 10.0);
    drop(sum1);
    // Same slot, new bytes: a computation built after the write sees them.
    write_f32(&mut buf, 0, &[10.0, 20.0, 30.0, 40.0]);
    let v = buf.view(0, &[4], Dtype::Float32).unwrap();
    assert_eq!(v.to_vec::<f32>().unwrap(), vec![10.0, 20.0, 30.0, 40.0]);
    drop(v);
    // A view at an offset reads the right bytes.
    write_f32(&mut buf, 32, &[-1.5, 2.5]);
    let tail = buf.view(32, &[2], Dtype::Float32).unwrap();
    assert_eq!(
        tail.multiply_scalar(2.0).unwrap().to_vec::<f32>().unwrap(),
        vec![-3.0, 5.0]
    );
}

#[test]
fn writes_are_refused_while_anything_can_read() {
    let mut buf = WritableBuffer::new(16).unwrap();
    write_f32(&mut buf, 0, &[1.0, 1.0, 1.0, 1.0]);
    // A pending (unevaluated) computation references the buffer.
    let pending = buf
        .view(0, &[4], Dtype::Float32)
        .unwrap()
        .sum(&[], false)
        .unwrap();
    assert!(matches!(
        buf.bytes_mut(),
        Err(MlxError::BufferBusy { bytes: 16 })
    ));
    assert_eq!(pending.item::<f32>().unwrap(), 4.0);
    drop(pending);
    // An evaluated view still shares the memory.
    let view = buf.view(0, &[4], Dtype::Float32).unwrap();
    view.eval().unwrap();
    assert!(buf.bytes_mut().is_err());
    drop(view);
    // A clone of the whole array is a reader too.
    let alias = buf.as_array().clone();
    assert!(!buf.is_exclusive());
    drop(alias);
    assert!(buf.is_exclusive());
    write_f32(&mut buf, 0, &[2.0, 2.0, 2.0, 2.0]);
    let s = buf
        .view(0, &[4], Dtype::Float32)
        .unwrap()
        .sum(&[], false)
        .unwrap();
    assert_eq!(s.item::<f32>().unwrap(), 8.0);
}

#[test]
fn q4_weights_written_in_place_feed_quantized_matmul() {
    // One 8×64 Q4 matrix (gs 64) written as Colibri bytes into a slot, then
    // used through a uint32 view: every nibble 9 (q = +1), scale 0.5 per row.
    let (rows, cols) = (8usize, 64usize);
    let mut buf = WritableBuffer::new(rows * cols / 2 + 4096).unwrap();
    let base = 4096; // 16-byte aligned sub-offset, as slots use
    buf.bytes_mut().unwrap()[base..base + rows * cols / 2].fill(0x99);
    let w = buf
        .view(base, &[rows as i32, (cols / 8) as i32], Dtype::Uint32)
        .unwrap();
    let s = mlx::full(&[rows as i32, 1], 0.5, Dtype::Float32).unwrap();
    let b = s.multiply_scalar(-8.0).unwrap();
    let x = mlx::full(&[1, cols as i32], 1.0, Dtype::Float32).unwrap();
    let y = mlx::quantized_matmul(&x, &w, &s, Some(&b), true, 64, 4).unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![32.0; rows]);
}

#[test]
fn bad_views_and_sizes_are_errors() {
    assert!(WritableBuffer::new(0).is_err());
    let buf = WritableBuffer::new(32).unwrap();
    assert!(buf.view(30, &[1], Dtype::Float32).is_err(), "past the end");
    assert!(buf.view(2, &[1], Dtype::Float32).is_err(), "misaligned");
    assert!(
        buf.view(usize::MAX - 1, &[4], Dtype::Uint8).is_err(),
        "overflow"
    );
}
