/**
 * A preset's row in the models panel: its download size and its GPU memory side by side, the memory being the sum the
 * fit label weighs. Rendered to static HTML with React's server renderer (no DOM needed).
 */
import { createElement } from 'react';
import { renderToStaticMarkup } from 'react-dom/server';
import { describe, expect, it } from 'vitest';
import { gpuMemoryParts } from '../models/model-fit.ts';
import { MODEL_PRESETS, presetGpuMemory } from '../models/presets.ts';
import { formatBytes } from '../storage/models.ts';
import { type FitContext, PresetRow } from './ModelsPanel.tsx';

const MiB = 1024 * 1024;
const fit: FitContext = { kvBudgetBytes: 64 * MiB, gpu: null, runningModelId: null };

const render = (preset: (typeof MODEL_PRESETS)[number], context = fit) =>
  renderToStaticMarkup(createElement(PresetRow, { preset, fit: context, stored: null, onDownload: () => {} }));

describe('PresetRow', () => {
  it('shows every preset with its download size and its GPU memory at the KV budget', () => {
    for (const preset of MODEL_PRESETS) {
      const html = render(preset);
      const memory = presetGpuMemory(preset, fit.kvBudgetBytes);
      expect(html).toContain(`data-testid="preset-${preset.id}"`);
      expect(html).toContain(`≈${formatBytes(preset.approxBytes)} (approx.)`);
      expect(html).toContain(`title="${gpuMemoryParts(memory)}">≈${formatBytes(memory.total)} GPU memory</span>`);
      expect(html).toContain('>Download</button>');
    }
  });

  it('shows the figures for one preset as a person reads them, and follows the KV budget', () => {
    const qwen = MODEL_PRESETS[0]!;
    expect(render(qwen)).toContain(
      '≈468 MiB (approx.) · <span data-testid="preset-gpu-memory" title="weights 468 MiB + KV budget 64 MiB + scratch 10 MiB">≈542 MiB GPU memory</span>',
    );
    expect(render(qwen, { ...fit, kvBudgetBytes: 512 * MiB })).toContain('≈990 MiB GPU memory');
  });

  it('weighs the same sum in its fit label', () => {
    const gpu = { maxBufferSize: 256 * MiB, maxStorageBufferBindingSize: 128 * MiB, peakBytes: 70 * MiB };
    const html = render(MODEL_PRESETS[0]!, { ...fit, gpu });
    expect(html).toContain('may not fit: needs about 542 MiB (weights 468 MiB + KV budget 64 MiB + scratch 10 MiB)');
  });
});
