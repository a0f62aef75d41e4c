/**
 * The presets the models panel offers: one per architecture the runtime runs, each a hub download of the usual layout
 * with its size and the GPU memory the fit check weighs.
 */
import { describe, expect, it } from 'vitest';
import { SUPPORTED_ARCHITECTURES } from '../../runtime/model/config.ts';
import { DEFAULT_SETTINGS } from '../storage/settings.ts';
import { gpuMemoryEstimate, scratchBytesEstimate } from './model-fit.ts';
import { CHAT_PRESET, hubUrl, MODEL_PRESETS, presetGpuMemory } from './presets.ts';

const MiB = 1024 * 1024;
const kvBudgetBytes = DEFAULT_SETTINGS.kvBudgetMiB * MiB;

describe('MODEL_PRESETS', () => {
  it('offers a chat preset for every architecture the runtime runs, and none it does not', () => {
    const covered = new Set(MODEL_PRESETS.map((p) => p.architecture));
    for (const arch of SUPPORTED_ARCHITECTURES) {
      expect(covered.has(arch), `no preset runs the '${arch}' architecture: add one to app/models/presets.ts`).toBe(
        true,
      );
    }
    expect([...covered].every((arch) => (SUPPORTED_ARCHITECTURES as readonly string[]).includes(arch))).toBe(true);
    expect(new Set(MODEL_PRESETS.map((p) => p.id)).size).toBe(MODEL_PRESETS.length);
    // One preset per model family (SmolLM2 and Llama 3.2 share the llama architecture).
    const families = MODEL_PRESETS.map((p) => p.family);
    expect(new Set(families).size).toBe(families.length);
    for (const preset of MODEL_PRESETS) expect(preset.label.startsWith(preset.family)).toBe(true);
  });

  it("downloads each from the hub's <base>/<repo>/resolve/main/<file> layout, a .gguf of a known size", () => {
    for (const preset of MODEL_PRESETS) {
      expect(preset.repo).toMatch(/^[\w.-]+\/[\w.-]+-GGUF$/);
      expect(preset.file).toMatch(/^[\w.-]+\.gguf$/);
      expect(hubUrl('https://huggingface.co/', preset.repo, preset.file)).toBe(
        `https://huggingface.co/${preset.repo}/resolve/main/${preset.file}`,
      );
      expect(preset.approxBytes).toBeGreaterThan(100e6);
      expect(preset.approxBytes).toBeLessThan(4e9);
    }
    // The demo's one-step offer stays the small first one.
    expect(CHAT_PRESET.id).toBe('qwen2.5-0.5b-instruct-q4_k_m');
  });

  it('says the GPU memory the fit check weighs: weights + the KV budget + scratch for its shape', () => {
    for (const preset of MODEL_PRESETS) {
      const memory = presetGpuMemory(preset, kvBudgetBytes);
      expect(memory).toEqual(gpuMemoryEstimate(preset.approxBytes, kvBudgetBytes, scratchBytesEstimate(preset.shape)));
      expect(memory.total).toBe(preset.approxBytes + kvBudgetBytes + memory.scratch);
      // Shapes from the models' configs: attention as wide as the KV heads divide, scratch a few tens of MB.
      expect(preset.shape.heads % preset.shape.kvHeads).toBe(0);
      expect(memory.scratch).toBeGreaterThan(4e6);
      expect(memory.scratch).toBeLessThan(60e6);
    }
    // Against a measurement: Llama 3.2 1B Q4_K_M's weights on the GPU, 803,029,120 bytes, within 1% of the file's.
    const llama = MODEL_PRESETS.find((p) => p.id === 'llama-3.2-1b-instruct-q4_k_m')!;
    expect(Math.abs(presetGpuMemory(llama, kvBudgetBytes).weights / 803_029_120 - 1)).toBeLessThan(0.01);
  });
});
