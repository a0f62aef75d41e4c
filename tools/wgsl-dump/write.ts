/**
 * A PipelineRecord as files: `<label>.wgsl` per pipeline (exactly the code compiled; a label compiled from several
 * codes gets `-2`, `-3`… in compile order), and `index.md` / `index.json`: label → file → entry point → phase →
 * the dispatches that bind it, with layer numbers folded (`blk.{0-35}.attn_norm`).
 */
import { mkdirSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import type { PipelineRecord, RecordedPipeline } from './record.ts';

export interface DumpIndexEntry extends Omit<RecordedPipeline, 'code' | 'dispatches'> {
  file: string;
  bytes: number;
  dispatches: string[];
}

const INDEX_FILES = ['index.md', 'index.json'];

/** A file name for a label: letters, digits, '.', '_' and '-' (spaces and the rest become '-'). */
function fileStem(label: string): string {
  return label.replace(/[^A-Za-z0-9._-]+/g, '-').replace(/^[.-]+/, '') || 'pipeline';
}

/** "0-4,7,10-12" for [0,1,2,3,4,7,10,11,12]. */
function ranges(numbers: number[]): string {
  const sorted = [...new Set(numbers)].sort((a, b) => a - b);
  const parts: string[] = [];
  for (let i = 0; i < sorted.length; i++) {
    let j = i;
    while (j + 1 < sorted.length && sorted[j + 1] === sorted[j] + 1) j++;
    parts.push(j === i ? String(sorted[i]) : `${sorted[i]}-${sorted[j]}`);
    i = j;
  }
  return parts.join(',');
}

/** Labels with the number `pattern` captures (its group 2, after group 1) folded into one label per template. */
function foldNumber(labels: readonly string[], pattern: RegExp): string[] {
  const groups = new Map<string, number[]>();
  for (const label of labels) {
    const m = pattern.exec(label);
    const template = m ? label.replace(pattern, '$1{}') : label;
    const list = groups.get(template) ?? [];
    if (m) list.push(Number(m[2]));
    groups.set(template, list);
  }
  return [...groups].map(([template, numbers]) =>
    numbers.length > 0
      ? template.replace('{}', numbers.length > 1 ? `{${ranges(numbers)}}` : String(numbers[0]))
      : template,
  );
}

/**
 * Dispatch labels with their weight part and layer numbers folded: embed#0 … embed#2 → embed#{0-2}, blk.0.rope …
 * blk.35.rope → blk.{0-35}.rope.
 */
export function foldLayers(labels: readonly string[]): string[] {
  return foldNumber(foldNumber(labels, /(#)(\d+)$/), /(blk\.|layer)(\d+)/);
}

/** Index entries of a record, files named as writeDump names them. */
export function dumpIndex(record: PipelineRecord): DumpIndexEntry[] {
  const used = new Map<string, number>();
  return record.pipelines.map(({ code, dispatches, ...p }) => {
    const stem = fileStem(p.label);
    const n = (used.get(stem) ?? 0) + 1;
    used.set(stem, n);
    return {
      ...p,
      file: `${stem}${n > 1 ? `-${n}` : ''}.wgsl`,
      bytes: new TextEncoder().encode(code).byteLength,
      dispatches: foldLayers(dispatches),
    };
  });
}

function markdownIndex(record: PipelineRecord, index: DumpIndexEntry[]): string {
  const features = Object.entries(record.features)
    .filter(([, on]) => on)
    .map(([name]) => name);
  const cell = (s: string) => s.replaceAll('|', '\\|');
  const budget = record.kvBudgetBytes ? `, KV budget ${record.kvBudgetBytes / 2 ** 20} MiB` : '';
  const lines = [
    `# WGSL pipelines: ${record.model}, kv ${record.kv}`,
    '',
    `${index.length} pipelines (${index.filter((e) => e.label === 'probe').length} of them load-time compile probes),`,
    `recorded by \`npm run wgsl:dump\` in ${record.seconds.toFixed(1)} s on ${record.adapter.description || record.adapter.vendor}`,
    `(features: ${features.join(', ') || 'none'}); prefill chunk ${record.prefillChunk}${budget}. Which kernels the`,
    'runtime picks depends on the device: tensor-core (subgroup matrix) builds appear only on a device that has them.',
    '',
    'Phase: `load` = ModelRunner.load (its probes and the warm-up decode step), `prefill` = the prefill graph of a full',
    'chunk, `rollback` = the KV promotion a rollback into 2-bit pages compiles.',
    '',
    '| label | file | entry | phase | dispatches |',
    '| --- | --- | --- | --- | --- |',
    ...index.map(
      (e) =>
        `| ${cell(e.label)} | [${e.file}](${e.file}) | ${e.entryPoint} | ${e.phase} | ${cell(e.dispatches.join(', ') || (e.label === 'probe' ? '(compile check)' : ''))} |`,
    ),
    '',
  ];
  return lines.join('\n');
}

/**
 * Writes the record into `dir` (created if missing). A folder that holds anything but .wgsl files and the index is
 * refused: --out must not be pointed at something else by mistake. Returns the files written.
 */
export function writeDump(record: PipelineRecord, dir: string): string[] {
  mkdirSync(dir, { recursive: true });
  const existing = readdirSync(dir);
  const foreign = existing.filter((f) => !f.endsWith('.wgsl') && !INDEX_FILES.includes(f));
  if (foreign.length > 0) {
    throw new Error(`${dir} holds files other than a dump (${foreign.slice(0, 3).join(', ')}): use another --out`);
  }
  for (const f of existing) rmSync(join(dir, f));
  const index = dumpIndex(record);
  record.pipelines.forEach((p, i) => {
    writeFileSync(join(dir, index[i].file), p.code);
  });
  const { pipelines: _, ...about } = record;
  writeFileSync(join(dir, 'index.json'), `${JSON.stringify({ ...about, pipelines: index }, null, 1)}\n`);
  writeFileSync(join(dir, 'index.md'), markdownIndex(record, index));
  return [...index.map((e) => e.file), ...INDEX_FILES];
}
