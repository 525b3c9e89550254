// What a helper needs of a tap test: a place to register its clean-up. A helper asks for no more
// than this, so that a test, a subtest, or a fixture of one can pass itself.
export interface Teardown {
  teardown(fn: () => Promise<void> | void): void;
}
