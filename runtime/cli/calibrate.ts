import { open, readFile, writeFile } from 'node:fs/promises';
import { InvalidRequestError } from '../../core/errors.ts';
import type { GpuContext } from '../../core/gpu/device.ts';
import { calibrateKvRotations, chooseKvPrecisionPlan, storedRotations } from '../calibration/calibrate.ts';
import type { PlanChoice } from '../calibration/precision-search.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { parseGguf } from '../gguf/parse.ts';
import { metadataEntriesOf, planGguf } from '../gguf/writer.ts';
import { resolveClipFormat } from '../kv/clip-fit.ts';
import { describePlan } from '../kv/precision-plan.ts';
import { nodeRotationCache } from '../kv/rotation-cache-node.ts';
import {
  encodeRotations,
  findStoredRotations,
  modelDigest,
  rotationMetadataEntries,
  type StoredRotations,
} from '../kv/rotation-store.ts';
import { readModelConfig } from '../model/config.ts';
import { numberFlag, type ParsedArgs, stringFlag } from './args.ts';
import { defaultModelPath } from './default-model.ts';

/**
 * `longtab calibrate [--model FILE] [--out FILE.bin] [--embed OUT.gguf] [--text FILE] [--tokens N] [--seed S]
 * [--plan-only]`: fits OSCAR rotations, their clip quantiles and the 2-bit cache's precision plan on text the model
 * generates itself with an f16 cache (or on --text), caches them under the model's digest, and optionally writes
 * them to a file or into a copy of the model. `--plan-only` keeps the rotations and clip the model already has (its
 * metadata, else the cache) and fits only the plan for them: rotations stored before plans existed get one.
 */
export async function runCalibrate(args: ParsedArgs, gpu: GpuContext): Promise<number> {
  const modelPath = stringFlag(args, 'model') ?? defaultModelPath();
  const wanted = numberFlag(args, 'tokens', DEFAULT_CLI_CALIBRATION_TOKENS);
  if (!Number.isInteger(wanted) || wanted < 16 || wanted > 16384)
    throw new InvalidRequestError('--tokens must be an integer in 16..16384.');
  const out = stringFlag(args, 'out');
  const embed = stringFlag(args, 'embed');
  const result = await calibrateModelFile(gpu, modelPath, {
    tokens: wanted,
    textPath: stringFlag(args, 'text'),
    seed: numberFlag(args, 'seed', 1),
    out,
    embed,
    planOnly: args.flags.has('plan-only'),
  });
  process.stdout.write(
    `${JSON.stringify({ model: modelPath, digest: result.digest, tokens: result.rotations.tokens, clip: result.rotations.clip ?? null, plan: result.plan, out: out ?? null, embed: embed ?? null })}\n`,
  );
  return 0;
}

/** Tokens `longtab calibrate` fits on unless told (and `eval`/`capacity` when they calibrate first). */
export const DEFAULT_CLI_CALIBRATION_TOKENS = 2048;

/**
 * Calibrates the model file at `modelPath` (self-generated text unless `textPath`), with progress on stderr, and
 * caches the result under its digest; `out` writes the encoded rotations, `embed` a copy of the model carrying them.
 */
export async function calibrateModelFile(
  gpu: GpuContext,
  modelPath: string,
  options: { tokens: number; textPath?: string; seed?: number; out?: string; embed?: string; planOnly?: boolean },
): Promise<{
  digest: string;
  rotations: StoredRotations;
  plan: { summary: string; bitsPerElementAt32K: number } | null;
}> {
  const engine = new ModelRunner(gpu);
  const source = await sourceFromPath(modelPath);
  try {
    await engine.load(source, { kv: 'f16' });
    const { tokenizer, config } = engine;
    const tokens = options.textPath
      ? tokenizer.encode(await readFile(options.textPath, 'utf8'), { addSpecial: true }).slice(0, options.tokens)
      : await selfGenerated(engine, options.tokens, options.seed ?? 1);
    const started = performance.now();
    const weights = engine.loaded!.weights;
    let rotations: StoredRotations;
    let chosen: PlanChoice | null;
    if (options.planOnly) {
      const { rotations: stored } = await findStoredRotations(engine.loaded!.file, source, config, nodeRotationCache());
      if (!stored) {
        throw new InvalidRequestError(
          `${modelPath} has no calibrated KV rotations to fit a plan for: drop --plan-only.`,
        );
      }
      const { groupSize } = resolveClipFormat(config, {});
      chosen = await chooseKvPrecisionPlan(gpu, config, weights, tokens, stored, groupSize, {
        onLayer: (l) => process.stderr.write(`\rfitting the precision plan: layer ${l + 1}/${config.layers}`),
      });
      rotations = { ...stored, ...(chosen ? { plan: chosen.plan } : {}) };
    } else {
      const fitted = await calibrateKvRotations(gpu, config, weights, tokens, {
        onProgress: (done, total) => process.stderr.write(`\rcalibrating: ${done}/${total} tokens`),
        onFitProgress: (done, total) => process.stderr.write(`\rcalibrating: fit step ${done}/${total}   `),
      });
      chosen = fitted.plan ?? null;
      rotations = storedRotations(fitted);
    }
    const plan = chosen ? { summary: describePlan(chosen.plan), bitsPerElementAt32K: chosen.bitsPerElement } : null;
    process.stderr.write(
      `\rcalibrated on ${tokens.length} tokens in ${((performance.now() - started) / 1000).toFixed(1)} s; plan: ${plan ? `${plan.summary} (${plan.bitsPerElementAt32K.toFixed(3)} bits per element at 32K)` : 'none (text too short for the probe)'}\n`,
    );
    const digest = await modelDigest(engine.loaded!.file, source);
    const bytes = encodeRotations(rotations);
    await nodeRotationCache().set(digest, bytes);
    if (options.out) await writeFile(options.out, bytes);
    if (options.embed) await writeModelWithRotations(modelPath, options.embed, engine, rotations);
    return { digest, rotations, plan };
  } finally {
    engine.unload();
    await source.close?.();
  }
}

/**
 * Before a command loads `modelPath` with calibrated rotations: calibrates it first (progress on stderr) when
 * neither its metadata nor the rotation cache holds any. Returns whether it calibrated.
 */
export async function ensureCalibrated(gpu: GpuContext, modelPath: string): Promise<boolean> {
  const source = await sourceFromPath(modelPath);
  try {
    const file = await parseGguf(source);
    const config = readModelConfig(file);
    if ((await findStoredRotations(file, source, config, nodeRotationCache())).rotations) return false;
  } finally {
    await source.close?.();
  }
  process.stderr.write(`${modelPath} has no calibrated KV rotations yet: calibrating first.\n`);
  await calibrateModelFile(gpu, modelPath, { tokens: DEFAULT_CLI_CALIBRATION_TOKENS });
  return true;
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
