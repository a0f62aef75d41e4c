/**
 * The folder tree is the architecture (docs/architecture.md): each product folder may import only the floors below
 * it, and product modules form no import cycle. Test files (`*.test.ts`) and the test, bench, tools and e2e folders
 * sit outside the product and may import anything; nothing in the product imports them.
 */
import { readdirSync, readFileSync, statSync } from 'node:fs';
import path from 'node:path';
import { describe, expect, it } from 'vitest';

const ROOT = path.resolve(import.meta.dirname, '..');

/** What each product folder may import, besides itself and npm packages. */
const ALLOWED: Record<string, readonly string[]> = {
  core: [],
  kernels: ['core'],
  runtime: ['core', 'kernels'],
  workers: ['core', 'runtime'],
  app: ['core', 'workers'],
};
const PRODUCT = Object.keys(ALLOWED);

function sourceFiles(dir: string): string[] {
  const out: string[] = [];
  for (const name of readdirSync(dir)) {
    const full = path.join(dir, name);
    if (statSync(full).isDirectory()) out.push(...sourceFiles(full));
    else if (/\.(ts|tsx)$/.test(name)) out.push(full);
  }
  return out;
}

const isTest = (file: string) => /\.test\.tsx?$/.test(file);
const folderOf = (file: string) => path.relative(ROOT, file).split(path.sep)[0];

/** Relative import targets of a file (static, dynamic and type imports, and re-exports). */
function importsOf(file: string): string[] {
  const src = readFileSync(file, 'utf8');
  const out: string[] = [];
  for (const m of src.matchAll(/(?:from|import)\s*\(?\s*['"](\.{1,2}\/[^'"]+)['"]/g)) {
    out.push(path.resolve(path.dirname(file), m[1]));
  }
  return out;
}

/** Imports that leave their folder for one it may not import: "from -> to", relative to the root. */
function layeringViolations(graph: ReadonlyMap<string, readonly string[]>): string[] {
  const violations: string[] = [];
  for (const [file, targets] of graph) {
    const from = folderOf(file);
    for (const target of targets) {
      const to = folderOf(target);
      if (to !== from && !ALLOWED[from]?.includes(to)) {
        violations.push(`${path.relative(ROOT, file)} -> ${path.relative(ROOT, target)}`);
      }
    }
  }
  return violations;
}

/** The import cycles among the graph's own modules, each as "a -> b -> a". */
function importCycles(graph: ReadonlyMap<string, readonly string[]>): string[] {
  const cycles: string[] = [];
  const state = new Map<string, 'open' | 'done'>();
  const stack: string[] = [];
  const visit = (file: string) => {
    state.set(file, 'open');
    stack.push(file);
    for (const target of graph.get(file) ?? []) {
      if (!graph.has(target)) continue;
      const s = state.get(target);
      if (s === 'open') {
        cycles.push([...stack.slice(stack.indexOf(target)), target].map((f) => path.relative(ROOT, f)).join(' -> '));
      } else if (!s) visit(target);
    }
    stack.pop();
    state.set(file, 'done');
  };
  for (const file of graph.keys()) if (!state.has(file)) visit(file);
  return cycles;
}

const productFiles = PRODUCT.flatMap((folder) => sourceFiles(path.join(ROOT, folder))).filter((f) => !isTest(f));
const graph = new Map(productFiles.map((f) => [f, importsOf(f)]));

describe('layering', () => {
  it('reads the real tree', () => {
    expect(productFiles.length).toBeGreaterThan(100);
    expect([...graph.values()].flat().some((t) => folderOf(t) === 'core')).toBe(true);
  });

  it('product folders import only the floors below them', () => {
    expect(layeringViolations(graph)).toEqual([]);
  });

  it('product modules form no import cycle', () => {
    expect(importCycles(graph)).toEqual([]);
  });

  it('finds an upward import and a cycle in a graph that has them', () => {
    const at = (p: string) => path.join(ROOT, p);
    const bad = new Map([
      [at('kernels/a.ts'), [at('runtime/b.ts'), at('core/c.ts')]],
      [at('runtime/b.ts'), [at('runtime/d.ts')]],
      [at('runtime/d.ts'), [at('runtime/b.ts')]],
      [at('core/c.ts'), []],
    ]);
    expect(layeringViolations(bad)).toEqual(['kernels/a.ts -> runtime/b.ts']);
    expect(importCycles(bad)).toEqual(['runtime/b.ts -> runtime/d.ts -> runtime/b.ts']);
  });
});
