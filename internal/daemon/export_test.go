package daemon

// MallocArenas is mallocArenas, for tests.
var MallocArenas = mallocArenas
