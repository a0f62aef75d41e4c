import { open, readFile, writeFile } from 'node:fs/promises';
import { InvalidRequestError } from '../../core/errors.ts';
import type { GpuContext } from '../../core/gpu/device.ts';
import { calibrateKvRotations } from '../calibration/calibrate.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { metadataEntriesOf, planGguf } from '../gguf/writer.ts';
import { nodeRotationCache } from '../kv/rotation-cache-node.ts';
import { encodeRotations, modelDigest, rotationMetadataEntries, type StoredRotations } from '../kv/rotation-store.ts';
import { numberFlag, type ParsedArgs, stringFlag } from './args.ts';
import { defaultModelPath } from './default-model.ts';

/**
 * `longtab calibrate [--model FILE] [--out FILE.bin] [--embed OUT.gguf] [--text FILE] [--tokens N] [--seed S]`:
 * fits OSCAR rotations for the int2 KV cache on text the model generates itself with an f16 cache (or on --text),
 * caches them under the model's digest, and optionally writes them to a file or into a copy of the model.
 */
export async function runCalibrate(args: ParsedArgs, gpu: GpuContext): Promise<number> {
  const modelPath = stringFlag(args, 'model') ?? defaultModelPath();
  const wanted = numberFlag(args, 'tokens', 2048);
  if (!Number.isInteger(wanted) || wanted < 16 || wanted > 16384)
    throw new InvalidRequestError('--tokens must be an integer in 16..16384.');
  const textPath = stringFlag(args, 'text');
  const engine = new ModelRunner(gpu);
  const source = await sourceFromPath(modelPath);
  try {
    await engine.load(source, { kv: 'f16' });
    const { tokenizer, config } = engine;
    const tokens = textPath
      ? tokenizer.encode(await readFile(textPath, 'utf8'), { addSpecial: true }).slice(0, wanted)
      : await selfGenerated(engine, wanted, numberFlag(args, 'seed', 1));
    const started = performance.now();
    const fitted = await calibrateKvRotations(gpu, config, engine.loaded!.weights, tokens, {
      onProgress: (done, total) => process.stderr.write(`\rcalibrating: ${done}/${total} tokens`),
    });
    process.stderr.write(
      `\rcalibrated on ${tokens.length} tokens in ${((performance.now() - started) / 1000).toFixed(1)} s\n`,
    );
    const rotations: StoredRotations = {
      key: fitted.key,
      value: fitted.value,
      tokens: tokens.length,
      ...(fitted.clip ? { clip: { key: fitted.clip.key, value: fitted.clip.value } } : {}),
    };
    const file = engine.loaded!.file;
    const digest = await modelDigest(file, source);
    const bytes = encodeRotations(rotations);
    await nodeRotationCache().set(digest, bytes);
    const out = stringFlag(args, 'out');
    if (out) await writeFile(out, bytes);
    const embed = stringFlag(args, 'embed');
    if (embed) await writeModelWithRotations(modelPath, embed, engine, rotations);
    process.stdout.write(
      `${JSON.stringify({ model: modelPath, digest, tokens: tokens.length, clip: rotations.clip ?? null, out: out ?? null, embed: embed ?? null })}\n`,
    );
    return 0;
  } finally {
    engine.unload();
    await source.close?.();
  }
}

/** Calibration text: the model's own sampled continuation of BOS, with an f16 cache. */
async function selfGenerated(engine: ModelRunner, count: number, seed: number): Promise<number[]> {
  const bos = engine.tokenizer.bosId;
  if (bos === undefined)
    throw new InvalidRequestError('This model has no BOS token to start calibration text from: pass --text FILE.');
  const result = await engine.generate({
    promptIds: [bos],
    maxTokens: count - 1,
    stopAtEog: false,
    sampling: { temperature: 0.8, topP: 0.95, seed },
  });
  return [bos, ...result.ids];
}

/** Copies a GGUF with the rotations added to (or replacing those in) its metadata, tensor data streamed. */
async function writeModelWithRotations(
  inputPath: string,
  outputPath: string,
  engine: ModelRunner,
  rotations: StoredRotations,
): Promise<void> {
  const file = engine.loaded!.file;
  const metadata = [
    ...metadataEntriesOf(file, (key) => !key.startsWith('longtab.kv.')),
    ...rotationMetadataEntries(rotations),
  ];
  const tensors = file.tensors.map((t) => ({ name: t.name, shape: t.shape, type: t.type }));
  const layout = planGguf({ metadata, tensors, alignment: file.alignment });
  const input = await open(inputPath, 'r');
  const output = await open(outputPath, 'w');
  try {
    await output.write(layout.header, 0, layout.header.byteLength, 0);
    for (let i = 0; i < file.tensors.length; i++) {
      const t = file.tensors[i];
      const chunk = 8 << 20;
      for (let done = 0; done < t.byteLength; done += chunk) {
        const length = Math.min(chunk, t.byteLength - done);
        const buffer = new Uint8Array(length);
        await input.read(buffer, 0, length, t.offset + done);
        await output.write(buffer, 0, length, layout.tensorOffsets[i] + done);
      }
    }
    await output.truncate(layout.fileSize);
  } finally {
    await input.close();
    await output.close();
  }
}
