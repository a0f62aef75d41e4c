/**
 * bench/results/INDEX.md lists every committed result file; this fails when a file was added, removed or changed
 * without `npm run results:index`, and checks the rules the index is derived by on small inputs.
 */
import { readFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { describe, expect, it } from 'vitest';
import {
  describeResult,
  headingAnchor,
  INDEX_PATH,
  journalSections,
  renderResultsIndex,
  shortCommit,
  UNKNOWN,
} from './results-index.ts';

const ROOT = resolve(import.meta.dirname, '..');

describe('bench/results/INDEX.md', () => {
  it('is what npm run results:index writes for the files in the tree', () => {
    const committed = readFileSync(join(ROOT, INDEX_PATH), 'utf8');
    expect(committed, `${INDEX_PATH} is out of date: run npm run results:index and commit it`).toBe(
      renderResultsIndex(ROOT),
    );
  });

  it('links only journal sections that exist', () => {
    const anchors = new Set(journalSections(readFileSync(join(ROOT, 'bench/journal.md'), 'utf8')).map((s) => s.anchor));
    const linked = [...readFileSync(join(ROOT, INDEX_PATH), 'utf8').matchAll(/\(\.\.\/journal\.md#([^)]+)\)/g)];
    expect(linked.length).toBeGreaterThan(300);
    expect(linked.map((m) => m[1]).filter((a) => !anchors.has(a))).toEqual([]);
  });
});

describe('describeResult', () => {
  it("takes a bench JSON's date, commit and adapter from its fields", () => {
    const report = {
      schema: 'longtab-bench/1',
      date: '2026-12-02T00:10:00.000Z',
      commit: 'bf741b952e8466a83620d4beef60f33a3bbb5099+dirty',
      adapter: { info: { vendor: 'nvidia', device: 'nvidia-h200', description: 'NVIDIA: 580.159.04' } },
      quick: false,
      finished: true,
      protocol: { repeats: 3 },
      rows: [
        { runtime: 'llama.cpp', model: 'qwen3-4b', weights: 'q4_0', kv: 'f16', context: 1024 },
        { runtime: 'longtab', model: 'qwen3-4b', weights: 'q4_0', kv: 'int2', context: 1024 },
      ],
    };
    // The name's date (a day earlier) loses to the field's.
    expect(describeResult('2026-12-01-nvidia-h200-x.json', JSON.stringify(report))).toEqual({
      date: '2026-12-02',
      commit: 'bf741b952e84+dirty',
      adapter: 'nvidia-h200',
      shows: 'bench: qwen3-4b × q4_0; llama.cpp KV f16; longtab KV int2; contexts 1024; 3 repeats',
    });
  });

  it('says unknown where neither the name nor the contents say', () => {
    expect(describeResult('notes.txt', '[log] nothing here\n')).toEqual({
      date: UNKNOWN,
      commit: UNKNOWN,
      adapter: UNKNOWN,
      shows: '(from the name) notes',
    });
    const d = describeResult('2026-11-30-probe.json', '{"args": {"shape": "probe"}}');
    expect([d.date, d.commit, d.adapter]).toEqual(['2026-11-30', UNKNOWN, UNKNOWN]);
  });

  it('reads a markdown heading and a profile header', () => {
    const md = '# Tiled matmul micro-benchmark 2026-11-29T22:21:35.787Z, commit 032f01b41263\n\n| a |\n';
    expect(describeResult('2026-11-29-nvidia-h200-matmul-micro.md', md)).toEqual({
      date: '2026-11-29',
      commit: '032f01b41263',
      adapter: 'nvidia-h200',
      shows: 'Tiled matmul micro-benchmark',
    });
    const profile = '[profile] generating x\nQwen3-4B q4_k_m, KV int2, context 8192, adapter NVIDIA: 580.159.04\n';
    expect(describeResult('2026-12-01-lavapipe-p.txt', profile).shows).toBe(
      'profile (bench/profile-decode.ts): Qwen3-4B q4_k_m, KV int2, context 8192',
    );
    expect(shortCommit('not a commit')).toBe(UNKNOWN);
  });
});

describe('journal sections', () => {
  it("anchor headings as GitHub does and resolve the journal's file shorthand", () => {
    const seen = new Map<string, number>();
    expect(headingAnchor("NVIDIA H200, 2026-11-30 (session 10): Qwen3-4B's cache at 1.5×", seen)).toBe(
      'nvidia-h200-2026-11-30-session-10-qwen3-4bs-cache-at-15',
    );
    expect(headingAnchor('Notes', seen)).toBe('notes');
    expect(headingAnchor('Notes', seen)).toBe('notes-1');
    const [s9, other] = journalSections(
      [
        '## NVIDIA H200, 2026-11-30 (session 9): a kernel',
        'Files: `...-final.{md,json}`, `...-session5-matvec.md`.',
        '### Session 9, continued',
        '## NVIDIA H200, 2026-11-29',
        'Files: `bench/results/2026-11-29-nvidia-h200-*`.',
      ].join('\n'),
    );
    expect(s9.session).toBe(9);
    const names9 = ['2026-11-30-nvidia-h200-session9-final.json', '2026-11-30-nvidia-h200-session5-matvec.md'];
    expect(names9.map((n) => s9.patterns.some((p) => p.test(n)))).toEqual([true, true]);
    expect(s9.patterns.some((p) => p.test('2026-11-30-nvidia-h200-session9-small.md'))).toBe(false);
    expect(other.patterns.some((p) => p.test('2026-11-29-nvidia-h200-matmul-micro.md'))).toBe(true);
  });
});
