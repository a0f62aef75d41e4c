/** Streams one tensor's bytes out of a ByteSource in bounded chunks, for uploads and repacking. */
import { InvalidRequestError, UnsupportedModelError } from '../../core/errors.ts';
import { type ByteSource, GGML_TYPE_INFO, type GgufTensorInfo } from '../../core/gguf-types.ts';

export const DEFAULT_TENSOR_CHUNK_BYTES = 8 * 1024 * 1024;

/**
 * Calls `onChunk` with consecutive pieces of the tensor's data, in order, each at most `chunkBytes` long.
 * Every chunk but the last ends on a block boundary of the tensor's type, so a consumer can repack block by block
 * without carrying partial blocks between chunks, and (when chunkBytes allows) is a multiple of 4 bytes, so chunks
 * can go straight to `queue.writeBuffer`, which needs 4-byte offsets. `onChunk` is awaited before the next read.
 */
export async function streamTensorBytes(
  source: ByteSource,
  tensor: GgufTensorInfo,
  chunkBytes: number = DEFAULT_TENSOR_CHUNK_BYTES,
  onChunk: (bytes: Uint8Array, offsetInTensor: number) => void | Promise<void>,
): Promise<void> {
  const info = GGML_TYPE_INFO[tensor.type];
  if (!info) {
    throw new UnsupportedModelError(`Tensor ${tensor.name} has GGML type ${tensor.type}, which longtab cannot read.`, {
      tensor: tensor.name,
      type: tensor.type,
    });
  }
  if (!Number.isSafeInteger(chunkBytes) || chunkBytes < info.blockBytes) {
    throw new InvalidRequestError(
      `chunkBytes must be a whole number of at least one ${info.name} block (${info.blockBytes} bytes); got ${chunkBytes}.`,
      { chunkBytes, blockBytes: info.blockBytes },
    );
  }
  const gpuFriendlyUnit = lcm(info.blockBytes, 4);
  const unit = chunkBytes >= gpuFriendlyUnit ? gpuFriendlyUnit : info.blockBytes;
  const alignedChunk = chunkBytes - (chunkBytes % unit);
  for (let offsetInTensor = 0; offsetInTensor < tensor.byteLength; offsetInTensor += alignedChunk) {
    const length = Math.min(alignedChunk, tensor.byteLength - offsetInTensor);
    const bytes = await source.read(tensor.offset + offsetInTensor, length);
    await onChunk(bytes, offsetInTensor);
  }
}

function lcm(a: number, b: number): number {
  let x = a;
  let y = b;
  while (y !== 0) [x, y] = [y, x % y];
  return (a / x) * b;
}
