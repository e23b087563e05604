package engine_test

import (
	"testing"

	engine "github.com/engine-project/engine/clients/go"
)

func TestCacheSaltAndPriorityAreTopLevelFields(t *testing.T) {
	req := engine.TextPrompt("x", engine.CacheSalt("tenant-a"), engine.Priority(-3))
	if req.GetCacheSalt() != "tenant-a" || req.GetPriority() != -3 {
		t.Errorf("cache_salt %q, priority %d; want tenant-a, -3", req.GetCacheSalt(), req.GetPriority())
	}
	if req.Sampling != nil || req.Stopping != nil || req.Output != nil {
		t.Error("CacheSalt / Priority set sub-messages they do not own")
	}
	if unset := engine.TextPrompt("x"); unset.GetCacheSalt() != "" || unset.GetPriority() != 0 {
		t.Errorf("defaults: %q, %d", unset.GetCacheSalt(), unset.GetPriority())
	}
}

func TestFlushCacheReturnsTheDroppedBlocks(t *testing.T) {
	client, _ := startFake(t)
	got, err := client.FlushCache(testContext(t))
	if err != nil || got != 7 {
		t.Errorf("FlushCache = %d, %v; want 7", got, err)
	}
}
