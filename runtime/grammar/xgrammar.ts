/**
 * The grammar engine: xgrammar's web build (`@mlc-ai/web-xgrammar`, WebAssembly), loaded on the first constrained
 * request only. Its bundle is UMD inside an ESM package: imported as a module it exports nothing and installs itself
 * as `globalThis.xgrammar`; outside a page or a worker (Node) its loader also needs CommonJS's `require` and
 * `__filename`, which the Node branch below supplies before the import.
 */
import type * as Xgrammar from '@mlc-ai/web-xgrammar';

export type XgrammarModule = typeof Xgrammar;

let loading: Promise<XgrammarModule> | null = null;

export function loadXgrammar(): Promise<XgrammarModule> {
  loading ??= (async () => {
    const g = globalThis as { xgrammar?: XgrammarModule; require?: unknown; __filename?: string };
    if (typeof document === 'undefined' && typeof location === 'undefined') {
      const { createRequire } = await import('node:module');
      g.require ??= createRequire(import.meta.url);
      g.__filename ??= new URL(import.meta.url).pathname;
    }
    const module = (await import('@mlc-ai/web-xgrammar')) as Partial<XgrammarModule>;
    const xgrammar = module.TokenizerInfo ? (module as XgrammarModule) : g.xgrammar;
    if (!xgrammar?.TokenizerInfo) throw new Error('@mlc-ai/web-xgrammar did not load: no TokenizerInfo');
    return xgrammar;
  })();
  loading.catch(() => {
    loading = null;
  });
  return loading;
}
